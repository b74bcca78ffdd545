"""`RngState`: the random generators' states at one moment — the one way the package takes them.

Three callers, one capture: a micro-batch's torch state before its forward (cheap, every step,
so that a root-cause replay draws the same dropout masks), a sandbox's every generator (torch,
CUDA, numpy's global one, Python's ``random``: whatever the code inside draws from is put back),
and a rollback snapshot's, saved in types ``torch.load(weights_only=True)`` accepts
(`RngState.to_dict`). CUDA's states are taken only when CUDA is initialised (asking for them
would start it on a CPU run).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["RngState", "get_rng_state", "set_rng_state"]


@dataclass(frozen=True)
class RngState:
    """The random states at `capture`.

    Args:
        cpu: ``torch.get_rng_state()``.
        cuda: Every initialised CUDA device's state; empty when CUDA was not initialised.
        numpy: numpy's global generator state (``everything`` only).
        python: Python's ``random`` state (``everything`` only).
    """

    cpu: Tensor
    cuda: tuple[Tensor, ...] = ()
    numpy: dict[str, Any] | None = None
    python: tuple[Any, ...] | None = None

    @classmethod
    def capture(cls, everything: bool = False) -> RngState:
        """The states now: torch's (host-side copies: cheap enough for every step), and with
        `everything` numpy's and Python's too."""
        cuda: tuple[Tensor, ...] = ()
        initialized: bool = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        if torch.cuda.is_available() and initialized:
            cuda = tuple(torch.cuda.get_rng_state_all())
        if not everything:
            return cls(torch.get_rng_state(), cuda)
        numpy_state: dict[str, Any] = np.random.get_state(legacy=False)
        return cls(torch.get_rng_state(), cuda, numpy_state, random.getstate())

    def restore(self) -> None:
        """Put the states back to what they were at capture."""
        torch.set_rng_state(self.cpu)
        if self.cuda:
            torch.cuda.set_rng_state_all(self.cuda)
        if self.numpy is not None:
            np.random.set_state(self.numpy)
        if self.python is not None:
            random.setstate(self.python)

    def to_dict(self) -> dict[str, Any]:
        """The states in types ``torch.load(weights_only=True)`` accepts: the Mersenne
        Twister's uint32 key held as int64 (exact), Python's tuples as they are."""
        state: dict[str, Any] = {"torch": self.cpu, "cuda": list(self.cuda)}
        if self.numpy is not None:
            mt = self.numpy["state"]
            key = torch.from_numpy(np.asarray(mt["key"]).astype(np.int64))
            state["numpy"] = {**self.numpy, "state": {"key": key, "pos": mt["pos"]}}
        if self.python is not None:
            state["python"] = self.python
        return state

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> RngState:
        """The inverse of `to_dict`."""
        numpy_state = state.get("numpy")
        if numpy_state is not None:
            mt = numpy_state["state"]
            key = mt["key"].numpy().astype(np.uint32)
            numpy_state = {**numpy_state, "state": {"key": key, "pos": mt["pos"]}}
        python = state.get("python")
        if python is not None:
            version, internal, gauss_next = python
            python = (version, tuple(internal), gauss_next)
        return cls(state["torch"], tuple(state.get("cuda", ())), numpy_state, python)


def get_rng_state() -> dict[str, Any]:
    """Every generator's state, savable with ``weights_only`` (a rollback snapshot's)."""
    return RngState.capture(everything=True).to_dict()


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back what `get_rng_state` returned."""
    RngState.from_dict(state).restore()
