"""`LRMultiplier`: scale the learning rate on top of any scheduler, without compounding.

Schedulers write ``param_group["lr"]`` every step, and the chainable ones (``CosineAnnealingLR``,
``StepLR``, ``ExponentialLR``, ``ReduceLROnPlateau``...) compute the next value *from* it, so an LR
scaled in the param group would be scaled again at every scheduler step. The multiplier instead
scales the LR only for the duration of ``optimizer.step()``: an optimizer step pre-hook writes
``lr × factor`` and a post-hook puts the scheduler's value back. Schedulers, checkpoints and LR
loggers only ever see the scheduler's own values; the step uses the scaled one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

__all__ = ["FactorChange", "LRMultiplier"]


@dataclass(frozen=True)
class FactorChange:
    """What `LRMultiplier.scale` or `LRMultiplier.warmup` changed.

    Attributes:
        before: Factor the next optimizer step would have used.
        after: Factor the next optimizer step uses now.
        warmup_steps: Length of the warmup ramp now in force (0: none).
    """

    before: float
    after: float
    warmup_steps: int = 0

    @property
    def changed(self) -> bool:
        """Whether the next step's factor differs from before."""
        return self.before != self.after


class LRMultiplier:
    """A factor on every param group's LR, applied inside each optimizer step.

    Either `attach` it to the optimizer (hooks call `apply` before and `restore` after every
    ``optimizer.step()``, including Lightning's and GradScaler's; a step the scaler skips counts
    for nothing), or call `apply`/`restore` around ``optimizer.step()`` by hand. The effective
    factor is `base` (set by `scale`) times a warmup ramp that rises linearly to 1 (`warmup`).

    Args:
        factor: Initial base factor.
    """

    def __init__(self, factor: float = 1.0) -> None:
        _check_factor("factor", factor)
        self.base = factor
        self.warmup_steps = 0  # length of the current ramp; 0: none
        self.warmup_done = 0  # steps of the ramp already taken
        self._saved: list[Any] | None = None  # the scheduler's LR per group while applied
        self._handles: list[RemovableHandle] = []

    @property
    def factor(self) -> float:
        """The factor the next optimizer step uses."""
        if self.warmup_done >= self.warmup_steps:
            return self.base
        return self.base * (self.warmup_done + 1) / self.warmup_steps

    def scale(self, factor: float) -> FactorChange:
        """Multiply the base factor by `factor` (e.g. ``0.5`` halves the LR from the next step)."""
        _check_factor("factor", factor)
        before = self.factor
        self.base *= factor
        return FactorChange(before, self.factor, self.warmup_steps - self.warmup_done)

    def warmup(self, steps: int) -> FactorChange:
        """Ramp the factor linearly from ``base / steps`` up to ``base`` over the next `steps`."""
        if steps < 1:
            raise ValueError(f"`steps` must be >= 1, got {steps}")
        before = self.factor
        self.warmup_steps, self.warmup_done = steps, 0
        return FactorChange(before, self.factor, steps)

    def apply(self, optimizer: Optimizer) -> None:
        """Scale each group's LR by `factor` for the coming step; call `restore` after it."""
        if self._saved is None:
            self._saved = [group["lr"] for group in optimizer.param_groups]
        factor = self.factor
        for group, lr in zip(optimizer.param_groups, self._saved, strict=False):
            group["lr"] = lr * factor
        self.warmup_done = min(self.warmup_done + 1, self.warmup_steps)

    def restore(self, optimizer: Optimizer) -> None:
        """Put back each group's unscaled LR (a no-op when `apply` was not called)."""
        if self._saved is None:
            return
        for group, lr in zip(optimizer.param_groups, self._saved, strict=False):
            group["lr"] = lr
        self._saved = None

    def attach(self, optimizer: Optimizer) -> None:
        """Apply the factor inside every ``optimizer.step()`` from now on (step hooks)."""
        self.detach()
        self._handles = [
            optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.apply(opt)),
            optimizer.register_step_post_hook(lambda opt, args, kwargs: self.restore(opt)),
        ]

    def detach(self) -> None:
        """Remove the hooks `attach` registered."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def state_dict(self) -> dict[str, float | int]:
        """The factor and warmup progress, for checkpoints."""
        return {"base": self.base, "warmup_steps": self.warmup_steps, "done": self.warmup_done}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore what `state_dict` returned."""
        self.base = float(state["base"])
        self.warmup_steps, self.warmup_done = int(state["warmup_steps"]), int(state["done"])


def _check_factor(name: str, value: float) -> None:
    if not value > 0.0:
        raise ValueError(f"`{name}` must be > 0, got {value}")
