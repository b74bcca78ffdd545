"""`AfterUnscale`: an fp16 step is measured the moment its grad scaler unscales it.

``torch.amp.GradScaler.step`` skips the optimizer when the gradients hold inf/NaN: the optimizer
is never called, so the guard inside it never sees that step, and the step would go unmeasured
(no record, no NaN reported). Every step passes through the scaler's ``unscale_`` though: a loop
calls it before clipping (nanoGPT, Fabric's ``clip_gradients``, accelerate's), and
``scaler.step`` calls it otherwise. Right after it the gradients are what the optimizer would
use, unscaled and not yet clipped: the step is measured there, as Lightning measures it in
``on_before_optimizer_step``. Only this scaler instance's ``unscale_`` is replaced, and `remove`
puts it back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["AfterUnscale"]


class AfterUnscale:
    """Calls `measure` with the optimizer each time `scaler` unscales its gradients.

    Args:
        scaler: The run's ``GradScaler``.
        measure: Measures an optimizer's coming step.
    """

    def __init__(self, scaler: Any, measure: Callable[[torch.optim.Optimizer], None]) -> None:
        self.scaler, self._measure = scaler, measure
        self._real = scaler.unscale_  # bound: the class's, or a wrapper set before us
        self._previous = scaler.__dict__.get("unscale_")
        scaler.unscale_ = self._unscale

    def _unscale(self, optimizer: torch.optim.Optimizer) -> None:
        self._real(optimizer)
        self._measure(optimizer)

    def remove(self) -> None:
        if self.scaler.__dict__.get("unscale_") != self._unscale:
            return  # wrapped again since: left as it is
        if self._previous is None:
            del self.scaler.__dict__["unscale_"]
        else:
            self.scaler.unscale_ = self._previous
