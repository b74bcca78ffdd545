"""Streaming detectors of training instabilities, and their registry.

Each detector lives in its own module, named after its snake_case `name` (`loss_spike.py` holds
`LossSpike`), which is also its registry key, CLI value and log tag segment. The registry holds
the detectors that the kinds table names (`Kind.detector` in `stabilizer.core.kinds`), in the
table's order: a new detector needs its module and its rows there, nothing here.
"""

from __future__ import annotations

import importlib
from typing import Any, cast

from stabilizer.core.kinds import detector_names

from .base import Detector
from .depth_imbalance import DepthImbalance
from .diverged import Diverged
from .fp16_overflow import Fp16Overflow
from .grad_spike import GradSpike
from .loss_spike import LossSpike
from .nonfinite import NonFinite
from .overflow_risk import OverflowRisk
from .stall import Stall

__all__ = [
    "DETECTORS",
    "DepthImbalance",
    "Detector",
    "Diverged",
    "Fp16Overflow",
    "GradSpike",
    "LossSpike",
    "NonFinite",
    "OverflowRisk",
    "Stall",
    "default_detectors",
    "make_detector",
]


def _detector(name: str) -> type[Detector]:
    """The class of module ``name`` whose `name` is ``name``."""
    module = importlib.import_module(f"{__name__}.{name}")
    found = [
        obj for obj in vars(module).values()
        if isinstance(obj, type) and getattr(obj, "name", None) == name
    ]  # fmt: skip
    if len(found) != 1:
        raise ImportError(f"{module.__name__} must hold one detector named {name!r}")
    return cast("type[Detector]", found[0])


DETECTORS: dict[str, type[Detector]] = {name: _detector(name) for name in detector_names()}
"""Every built-in detector class by its snake_case name, in the engine's default order."""


def default_detectors() -> list[Detector]:
    """One instance of every registered detector, with default arguments."""
    return [cls() for cls in DETECTORS.values()]


def make_detector(name: str, **kwargs: Any) -> Detector:
    """A detector by registry name: ``make_detector("loss_spike", window=100)``.

    Raises:
        ValueError: ``name`` is not registered; the message lists the valid names.
    """
    if name not in DETECTORS:
        raise ValueError(f"`name` must be one of {', '.join(DETECTORS)}, got {name!r}")
    return DETECTORS[name](**kwargs)
