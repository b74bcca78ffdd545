"""The batch in flight: its micro-batches, losses and optimizer steps, until they are reported.

A host hands the step a batch's pieces at separate moments: each micro-batch (`Batch.begin`),
each loss before its backward (`Batch.add_loss`), one measurement per optimizer step (one per
batch under automatic optimization, one per ``opt.step()`` under manual optimization, several
optimizers included) and the end of the batch. Between its measurement and its report an
optimizer step is an `InFlight`: what was measured (a frozen `Measurement`), what the guard
decided (a frozen `Decision`) and what the checks found, written only by the step's own modules
— the guard's judge and the checks (`stabilizer.step.protect`), the monitor (findings) — and
read by the report as one frozen `StepOutcome`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
    NEW_DATA,
    NONFINITE_GRADS,
    NONFINITE_UPDATE,
    NONFINITE_WEIGHTS,
    SKIPPED,
)
from stabilizer.live.rng import RngState
from stabilizer.live.tensors import wide_dtype

from .guard import BAD_GRADS, BAD_LOSS, BAD_LR, BAD_WEIGHTS, UNCHECKED, Decision
from .host import MicroBatch
from .measurement import Measurement, lr_key

__all__ = ["Batch", "InFlight", "StepOutcome"]

# The guard's reasons that make a step bad (a rollback's stepping past does not).
_BAD_REASONS = frozenset({BAD_LOSS, BAD_GRADS, BAD_LR, BAD_WEIGHTS, UNCHECKED})
_F32_MAX = float(np.finfo(np.float32).max)


@dataclass
class InFlight:
    """One optimizer step between its measurement and its report (see the module).

    Args:
        measurement: What was measured.
        guarded: A guard decides on it (``protect``, ``auto``).
        decision: The guard's decision, once its judge ran (the optimizer was called).
        reverted: The guard undid the step's non-finite update.
        replayed: Its root cause was looked for.
        found: The step's findings that only the monitor knows (root cause, set-up notes).
        recount: Counts the weights that turned non-finite, exactly (a sync), if guarded.
        new_data: The step drew the first batch of a dataloader the run had not used before.
    """

    measurement: Measurement
    guarded: bool = False
    decision: Decision | None = None
    reverted: bool = False
    replayed: bool = False
    found: list[Finding] = field(default_factory=list)
    recount: Callable[[], float] | None = None
    new_data: bool = False
    _confirmed: float | None = None  # `weights_nonfinite`, counted exactly

    @property
    def step(self) -> int:
        return self.measurement.step

    @property
    def reason(self) -> str:
        return self.decision.reason if self.decision is not None else ""

    @property
    def weights_nonfinite(self) -> float:
        """How many of the parameters, optimizer state and buffers turned NaN/Inf: 0 when the
        fast test was negative, else counted exactly over all of them (a sync, once)."""
        if self._confirmed is None:
            if not self.measurement.weights_suspect:
                return 0.0
            self.check_all()
        return self._confirmed or 0.0

    @property
    def weights_bad(self) -> bool:
        return self.weights_nonfinite > 0

    def check_all(self) -> None:
        """Count exactly, over all of them as they are now (a sync): for a skipped step, whose
        "weights intact" is then a fact checked in full."""
        self._confirmed = self.recount() if self.recount is not None else 0.0

    @property
    def overflow(self) -> bool:
        """An fp16 grad scaler skipped the step: it never called the optimizer."""
        m = self.measurement
        return m.scaled and self.decision is None and m.guard_values().get(NONFINITE_GRADS, 0) > 0

    @property
    def skipped(self) -> bool:
        """Whether the update did not happen: the guard skipped or undid it, or the scaler."""
        skip = self.decision is not None and self.decision.skip
        return skip or self.reverted or self.overflow

    @property
    def bad(self) -> bool:
        """Non-finite or not checked: counts towards ``stop_after`` (a scaler's overflow skip
        does not: it is the scaler's normal business)."""
        m = self.measurement
        if m.numbers is None or self.weights_bad:
            return True
        values = m.guard_values()
        loss_bad = LOSS in values and not math.isfinite(values[LOSS])
        grads_bad = values[NONFINITE_GRADS] > 0 and not m.scaled
        return loss_bad or grads_bad or self.reason in _BAD_REASONS

    def unchecked(self) -> Finding:
        """The critical finding of a step the guard could not check (and so skipped)."""
        message = (
            f"the guard could not check this step ({self.measurement.error}): its update was "
            "skipped"
        )
        return Finding(
            kind=GUARD_ERROR, step=self.step, end_step=self.step, severity=Severity.CRITICAL,
            seen=message,
        )  # fmt: skip

    def outcome(self) -> StepOutcome:
        """The step as reported: frozen."""
        values = _values(self) if self.measurement.numbers is not None else None
        return StepOutcome(self.measurement, values, tuple(self.found), self.skipped)


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step measured and decided, as the report reads it.

    Args:
        measurement: What was measured.
        values: The step record's values; None when the step could not be measured.
        found: The monitor's own findings of the step.
        skipped: Its update did not happen.
    """

    measurement: Measurement
    values: dict[str, float] | None
    found: tuple[Finding, ...]
    skipped: bool

    @property
    def step(self) -> int:
        return self.measurement.step


def _values(step: InFlight) -> dict[str, float]:
    """The step record's values."""
    m = step.measurement
    host = [_f32(v) for v in m.host()]  # as TensorBoard keeps them (replay parity)
    n = len(m.grad_keys)
    values = dict(zip(m.grad_keys, host[:n], strict=True))
    for key in m.gradless:  # no gradient is not a zero gradient
        del values[key]
    loss, scale = host[n], host[n + 1]
    # The host scales the loss by the grad scaler's scale before handing it over (the gradients
    # carry the same factor, which the scaler's `unscale_` removed before the measurement).
    if m.has_loss:
        values[LOSS] = float(np.float32(loss / scale)) if m.scaled else loss
    values.update((lr_key(i), lr) for i, lr in enumerate(m.lrs))
    if m.scaled:
        values[LOSS_SCALE] = scale
    if m.clip:
        values[CLIP_VAL] = m.clip
        values[CLIPPED] = float(values[GRAD_NORM] > m.clip)
    values.update(zip(m.act_keys, host[n + 3 :], strict=True))
    if step.guarded or m.scaled:
        values[SKIPPED] = float(step.skipped)
    if step.guarded:
        values[NONFINITE_WEIGHTS] = step.weights_nonfinite
    if step.reverted:
        values[NONFINITE_UPDATE] = 1.0
    if step.new_data:
        values[NEW_DATA] = 1.0
    return values


def _f32(value: float) -> float:
    """`value` rounded to float32, where float32 holds it (a finite 1e300 stays finite)."""
    return float(np.float32(value)) if abs(value) <= _F32_MAX else value


class Batch:
    """Micro-batches and optimizer steps of the batch in flight.

    Args:
        keep_batches: Keep the micro-batches themselves (for a root-cause replay).
    """

    def __init__(self, keep_batches: bool = False) -> None:
        self.keep_batches = keep_batches
        self.micro: list[MicroBatch] = []
        self.steps: list[InFlight] = []  # measured in this batch, in order
        self._by_optimizer: dict[int, InFlight] = {}  # measured, not stepped yet
        self._since_step: list[torch.Tensor] = []  # losses backpropagated since the last step
        self._last_loss: torch.Tensor | None = None  # the last step's, within this batch

    def begin(self, batch: Any, index: int, rng: RngState | None) -> bool:
        """A micro-batch starts; True when it is the first of an optimizer step."""
        first = not self.micro
        if first:
            self._last_loss = None
        kept = batch if self.keep_batches else None
        self.micro.append(MicroBatch(kept, index, rng if self.keep_batches else None))
        return first

    def add_loss(self, loss: torch.Tensor) -> None:
        """A backward is about to run on `loss` (divided by the accumulation, under it)."""
        loss = loss.detach().to(wide_dtype(loss.device))  # a finite 1e300 (64-true) stays finite
        self._since_step.append(loss)
        if self.micro:
            self.micro[-1].losses.append(loss)

    def step_loss(self) -> torch.Tensor | None:
        """The coming step's loss: the sum over the micro-batches since the last step; the last
        step's again when a second optimizer steps on the same backward; None without any."""
        if self._since_step:
            total = self._since_step[0]
            for loss in self._since_step[1:]:
                total = total + loss
            self._since_step, self._last_loss = [], total
            return total
        return self._last_loss

    def add(self, optimizer: torch.optim.Optimizer, step: InFlight) -> None:
        self.steps.append(step)
        self._by_optimizer[id(optimizer)] = step

    def current(self, optimizer: torch.optim.Optimizer) -> InFlight | None:
        """The measured step of this optimizer, not reported yet, if one was measured."""
        return self._by_optimizer.get(id(optimizer))

    def end(self) -> list[InFlight]:
        """The batch is done: its steps (none while accumulating)."""
        steps = self.steps
        if steps:
            self.steps, self.micro, self._by_optimizer = [], [], {}
        return steps
