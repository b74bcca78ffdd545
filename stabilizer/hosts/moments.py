"""When a host outside Lightning measures a step: after the last backward, before the clipping.

Lightning measures a step in ``on_before_optimizer_step``: the gradients accumulated, unscaled,
not yet clipped. Other loops have no such hook; the step is measured at the same point by:

- `AfterUnscale`: an fp16 ``torch.amp.GradScaler`` skips the optimizer when the gradients hold
  inf/NaN, so the guard inside the optimizer never sees that step. Every step passes through the
  scaler's ``unscale_`` though (a loop calls it before clipping, as nanoGPT, Fabric and
  accelerate do; ``scaler.step`` calls it otherwise): the step is measured right after it. Only
  this scaler instance's ``unscale_`` is replaced, and `AfterUnscale.remove` puts it back. (A
  fused optimizer unscales inside its own step: the scaler calls it whatever its gradients
  hold, and the guard measures it there, the norms divided by the scale they still carry.)
- `after_backward`: at the end of a backward, after every callback queued during it (DDP's
  all-reduce of the gradients is one), before any clipping that follows it.
- otherwise the guard measures the step itself, inside ``optimizer.step``.

A step measured already is not measured again (`stabilizer.step.monitor.RunMonitor.before_step`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["AfterUnscale", "after_backward"]


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


def after_backward(tensor: torch.Tensor, fn: Callable[[], None]) -> None:
    """Call `fn` when the backward through `tensor` is over: queued from inside it, at its
    end, behind every callback queued during it (DDP queues its all-reduce's end late in the
    backward, after `tensor`'s gradient hook has run)."""
    engine: Any = torch.autograd.Variable._execution_engine

    def hook(grad: torch.Tensor) -> None:
        engine.queue_callback(lambda: engine.queue_callback(fn))

    tensor.register_hook(hook)  # type: ignore[no-untyped-call]
