"""Streaming detectors of training instabilities, and their registry.

Each detector lives in its own module, named after it (`loss_spike.py` holds `LossSpike`), and is
registered here under its snake_case `name`, which is also its CLI value and its log tag segment.
"""

from __future__ import annotations

from typing import Any

from .base import Detector
from .depth_imbalance import DepthImbalance
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
    "Fp16Overflow",
    "GradSpike",
    "LossSpike",
    "NonFinite",
    "OverflowRisk",
    "Stall",
    "default_detectors",
    "make_detector",
]

DETECTORS: dict[str, type[Detector]] = {
    cls.name: cls
    for cls in (NonFinite, LossSpike, GradSpike, Fp16Overflow, OverflowRisk, DepthImbalance, Stall)
}
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
