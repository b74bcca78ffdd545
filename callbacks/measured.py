"""`Measured`: one optimizer step as the monitor measured it, and what the host knows of it.

A `Measured` holds the step's numbers on their way to the host (`HostCopy`, one copy per step)
with its LRs, the clipping threshold and the guard's verdict; `Measured.values` makes the step
record's values of it once they are needed, which on a GPU is a step later (see
``StabilityMonitor``). The numbers are made in `stabilizer.callbacks.measure`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

from stabilizer.core.kinds import GUARD_ERROR
from stabilizer.core.records import Finding, Severity
from stabilizer.core.signals import (
    CLIP_VAL,
    CLIPPED,
    GRAD_NORM,
    LOSS,
    LOSS_SCALE,
    LR,
    NONFINITE_GRADS,
    NONFINITE_UPDATE,
    NONFINITE_WEIGHTS,
    SKIPPED,
)
from stabilizer.live.probes import GradProbe, HostCopy

from .guard import BAD_GRADS, BAD_LOSS, BAD_LR, BAD_WEIGHTS, UNCHECKED

__all__ = ["Measured", "lr_key"]

# The guard's reasons that make a step bad (a rollback's stepping past does not).
_BAD_REASONS = frozenset({BAD_LOSS, BAD_GRADS, BAD_LR, BAD_WEIGHTS, UNCHECKED})


def lr_key(group: int) -> str:
    """The logged key of a param group's LR: ``lr`` for the first, then ``lr/pg2``, ``lr/pg3`` …

    Numbered from 1 as Lightning's ``LearningRateMonitor`` numbers them (its ``pg1`` is ``lr``).
    """
    return LR if group == 0 else f"{LR}/pg{group + 1}"


@dataclass
class Measured:
    """One optimizer step: its numbers (on their way to the host) and what the host knows.

    Args:
        step: ``trainer.global_step`` of the step.
        numbers: The copy of the step's numbers, ordered as ``grad_keys``, loss, loss scale,
            non-finite weights, ``act_keys``; None when measuring failed.
        grad_keys: The gradient probe's keys at this step.
        gradless: Those of them whose group had no gradient at all (left out of the record).
        act_keys: The activation keys, on a sampled step; else empty.
        scaled: An fp16 grad scaler runs: the loss is scaled, the scaler skips overflow.
        error: Why measuring failed.
        has_loss: A backward ran since the last step (a training step that returned None
            has none: a skipped batch, not a NaN).
    """

    step: int
    numbers: HostCopy | None
    grad_keys: list[str] = field(default_factory=list)
    gradless: frozenset[str] = frozenset()
    act_keys: list[str] = field(default_factory=list)
    scaled: bool = False
    error: str = ""
    has_loss: bool = True
    lrs: list[float] = field(default_factory=list)  # each param group's, as the step uses it
    clip: float | None = None  # the gradient clipping threshold in force
    guarded: bool = False  # a guard decided on the step (protect, auto)
    judged: bool = False  # the guard's judge ran: the optimizer was called for this step
    skip: bool = False  # the guard skipped the optimizer step
    reason: str = ""  # why (`stabilizer.callbacks.guard.decide`)
    reverted: bool = False  # the guard undid the step's non-finite update
    replayed: bool = False  # its root cause was looked for
    found: list[Finding] = field(default_factory=list)  # the monitor's own findings of the step
    probe: GradProbe | None = None  # the probe that measured it (whether its gradients changed)
    optimizer_index: int = 0  # its optimizer's place in the Trainer's (each its own stream)
    # the protection's exact count of the weights that turned non-finite (a sync), if it guards
    recount: Callable[[], float] | None = None
    _confirmed: float | None = None  # `weights_nonfinite`, counted exactly

    @classmethod
    def failed(cls, step: int, error: Exception) -> Measured:
        """A step that could not be measured, and why (one line)."""
        lines = str(error).strip().splitlines()
        why = type(error).__name__ + (f": {lines[0][:200]}" if lines else "")
        return cls(step, None, error=why)

    def note(
        self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer, lr_factor: float, guarded: bool
    ) -> None:
        """Add what the host knows: each param group's LR (times `lr_factor`), the clipping."""
        self.lrs = [_lr(g["lr"]) * lr_factor for g in optimizer.param_groups]
        clip = trainer.gradient_clip_val
        self.clip = float(np.float32(clip)) if clip else None
        self.guarded = guarded

    def unchecked(self) -> Finding:
        """The critical finding of a step the guard could not check (and so skipped)."""
        message = f"the guard could not check this step ({self.error}): its update was skipped"
        return Finding(
            kind=GUARD_ERROR, step=self.step, end_step=self.step, severity=Severity.CRITICAL,
            seen=message,
        )  # fmt: skip

    def guard_values(self) -> dict[str, float]:
        """Total gradient norm, non-finite count and (when a backward ran) the loss: what the
        guard decides on. Empty when the step could not be measured. Waits for the copy (the
        step's one host read)."""
        if self.numbers is None:
            return {}
        host = self.numbers.read()
        n = len(self.grad_keys)
        values = {GRAD_NORM: host[0], NONFINITE_GRADS: host[1]}
        if self.has_loss:
            values[LOSS] = host[n]
        return values

    @property
    def loss_scale(self) -> float:
        """The grad scaler's scale at the step (1 without one)."""
        if not self.scaled or self.numbers is None:
            return 1.0
        return self.numbers.read()[len(self.grad_keys) + 1]

    @property
    def weights_bad(self) -> bool:
        """The parameters, optimizer state or buffers held a NaN/Inf before this step."""
        return self.weights_nonfinite > 0

    @property
    def weights_nonfinite(self) -> float:
        """How many of the parameters, optimizer state and buffers turned NaN/Inf: 0 when the
        device's fast test of this step's share of them (`Protection.weights_check`) is
        negative, else counted exactly over all of them (a sync, once). `check_all` counts all
        of them whatever the test said."""
        if self.numbers is None:
            return 0.0
        if self._confirmed is None:
            if self.numbers.read()[len(self.grad_keys) + 2] <= 0:
                return 0.0
            self.check_all()
        return self._confirmed or 0.0

    def check_all(self) -> None:
        """Count the non-finite tensors exactly, over all of them as they are now (a sync): for
        a skipped step, whose "weights intact" is then a fact checked in full."""
        self._confirmed = self.recount() if self.recount is not None else 0.0

    @property
    def overflow(self) -> bool:
        """An fp16 grad scaler skipped the step: it never called the optimizer."""
        return self.scaled and not self.judged and self.guard_values().get(NONFINITE_GRADS, 0) > 0

    @property
    def skipped(self) -> bool:
        """Whether the update did not happen: the guard skipped or undid it, or the scaler."""
        return self.skip or self.reverted or self.overflow

    @property
    def bad(self) -> bool:
        """Non-finite or not checked: counts towards `stop_after` (a scaler's overflow skip does
        not: it is the scaler's normal business)."""
        values = self.guard_values()
        if self.numbers is None or self.weights_bad:
            return True
        loss_bad = LOSS in values and not math.isfinite(values[LOSS])
        grads_bad = values[NONFINITE_GRADS] > 0 and not self.scaled
        return loss_bad or grads_bad or self.reason in _BAD_REASONS

    def values(self) -> dict[str, float] | None:
        """The step record's values; None when the step could not be measured."""
        if self.numbers is None:
            return None
        host = [_f32(v) for v in self.numbers.read()]  # as TensorBoard keeps them (replay parity)
        n = len(self.grad_keys)
        values = dict(zip(self.grad_keys, host[:n], strict=True))
        for key in self.gradless:  # no gradient is not a zero gradient
            del values[key]
        loss, scale = host[n], host[n + 1]
        # Lightning's AMP plugin multiplies the loss by the grad scaler's scale before
        # `on_before_backward` hands it over (the gradients carry the same factor, which the
        # scaler's `unscale_` removed before `on_before_optimizer_step`): divide it back out.
        if self.has_loss:
            values[LOSS] = float(np.float32(loss / scale)) if self.scaled else loss
        values.update((lr_key(i), lr) for i, lr in enumerate(self.lrs))
        if self.scaled:
            values[LOSS_SCALE] = scale
        if self.clip:
            values[CLIP_VAL] = self.clip
            values[CLIPPED] = float(values[GRAD_NORM] > self.clip)
        values.update(zip(self.act_keys, host[n + 3 :], strict=True))
        if self.guarded or self.scaled:
            values[SKIPPED] = float(self.skipped)
        if self.guarded:
            values[NONFINITE_WEIGHTS] = self.weights_nonfinite
        if self.reverted:
            values[NONFINITE_UPDATE] = 1.0
        return values


def _f32(value: float) -> float:
    """`value` rounded to float32, where float32 holds it (a finite 1e300 stays finite)."""
    return float(np.float32(value)) if abs(value) <= _F32_MAX else value


_F32_MAX = float(np.finfo(np.float32).max)


def _lr(lr: Any) -> float:
    """An LR as a float32-rounded Python float (a tensor LR is read once: host side)."""
    value = float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)
    return float(np.float32(value)) if math.isfinite(value) else value
