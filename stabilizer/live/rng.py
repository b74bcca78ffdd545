"""Every random number generator's state as plain tensors and ints, savable with weights_only."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["get_rng_state", "set_rng_state"]


def get_rng_state() -> dict[str, Any]:
    """The states of torch's CPU generator, every CUDA device's (when available), numpy's global
    generator and Python's ``random``, in types ``torch.load(weights_only=True)`` accepts."""
    numpy_state = np.random.get_state(legacy=False)
    mt = numpy_state["state"]
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        # The Mersenne Twister key is uint32; int64 holds it exactly and torch stores it safely.
        "numpy": {
            **numpy_state,
            "state": {"key": torch.from_numpy(mt["key"].astype(np.int64)), "pos": mt["pos"]},
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back what `get_rng_state` returned."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    numpy_state = state["numpy"]
    mt = numpy_state["state"]
    key = mt["key"].numpy().astype(np.uint32)
    np.random.set_state({**numpy_state, "state": {"key": key, "pos": mt["pos"]}})
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
