"""One optimizer step, top to bottom: its stages, and everything said of it read from them.

Torch's ``GradScaler`` keeps an ``OptState`` per optimizer (ready, unscaled, stepped); each
optimizer step here is an `OptimizerStep` with a `Stage`, and its transitions — the methods
below, in the order a step goes through them — are the only writers of its state:

1. **ready** (`InFlight.open`): the step opens when its optimizer is about to step, holding the
   loss backpropagated since the last step and the micro-batches that made it;
2. **measured** (`OptimizerStep.measure`): its numbers were taken on the device, when the
   gradients were ready (`stabilizer.step.measurement`);
3. **decided** (`OptimizerStep.decide`): inside ``optimizer.step``, after every hook and the
   clipping, on the gradients and LR as the optimizer will use them (`stabilizer.step.guard`);
4. how it ended: **stepped** (the optimizer ran), **skipped** (the guard withheld it, or the
   grad scaler found inf/NaN and never called the optimizer), **reverted** (it ran, its result
   was non-finite and was put back), or **abandoned** (the block ended and the optimizer never
   ran: the loop stepped past it; nothing of it carries into the next step);
5. **reported** (`OptimizerStep.report`): its record and findings went out.

Who moves it: the run (`stabilizer.step.monitor.RunMonitor`) at the moments its host hands over
— a micro-batch begins (`InFlight.begin`), a loss is backpropagated (`InFlight.add_loss`), the
gradients are ready (open and measure), the guard inside ``optimizer.step`` asks for the
decision and says how it went (decide, then stepped, skipped or reverted), the block ends
(`InFlight.end`: what is still open is the scaler's skip or abandoned). Then the policy's
runtime checks and counts the ended steps (`stabilizer.step.protect`) and the reporter reports
them (`stabilizer.step.report`).

A transition from a stage that does not allow it is a bug of ours: `StageError`. Every claim
an output makes about a step — its update applied, skipped, undone or never made, "weights
intact" — is read from its stage and its checked numbers here, never inferred elsewhere. The
step holds its loss and micro-batches (device tensors, a replay's inputs) only until its block
ends (`OptimizerStep.let_go`), even when its report comes a step later.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from enum import Enum
from typing import Any

import numpy as np
import torch

from stabilizer.core.signals import (
    CLIP_VAL,
    CLIPPED,
    GRAD_NORM,
    LOSS,
    LOSS_SCALE,
    LR,
    NEW_DATA,
    NONFINITE_GRADS,
    NONFINITE_UPDATE,
    NONFINITE_WEIGHTS,
    SKIPPED,
)
from stabilizer.live.rng import RngState
from stabilizer.live.tensors import wide_dtype

from .carried import Carried, let_go
from .guard import BAD_GRADS, BAD_LOSS, BAD_LR, BAD_WEIGHTS, STEPPING_PAST, UNCHECKED, Decision
from .host import MicroBatch
from .measurement import Measurement, Numbers

__all__ = ["InFlight", "OptimizerStep", "Stage", "StageError", "parameters"]

_BAD_REASONS = frozenset({BAD_LOSS, BAD_GRADS, BAD_LR, BAD_WEIGHTS, UNCHECKED})
_F32_MAX = float(np.finfo(np.float32).max)


class Stage(Enum):
    """Where an optimizer step is (the module docstring)."""

    READY = "ready"
    MEASURED = "measured"
    DECIDED = "decided"
    STEPPED = "stepped"
    SKIPPED = "skipped"
    REVERTED = "reverted"
    ABANDONED = "abandoned"
    REPORTED = "reported"


_ENDED = (Stage.STEPPED, Stage.SKIPPED, Stage.REVERTED, Stage.ABANDONED)


class StageError(RuntimeError):
    """A step was moved from a stage that does not allow it (a bug of the step's)."""


class OptimizerStep:
    """One optimizer step of one optimizer (see the module).

    Args:
        step: The host's global step.
        optimizer_index: Its optimizer's place among the host's (each its own stream).
        loss: The loss backpropagated for it (the micro-batches' sum), or None without one.
        micro: Its micro-batches (kept for a root-cause replay).
        new_data: It drew the first batch of a dataloader the run had not used before.
        guarded: Its policy decides on it (``protect``, ``auto``): its record says whether it
            was skipped and what the weights' check found.
    """

    def __init__(
        self,
        step: int,
        optimizer_index: int,
        loss: torch.Tensor | None,
        micro: Sequence[MicroBatch],
        new_data: bool = False,
        guarded: bool = False,
    ) -> None:
        self.step, self.optimizer_index, self.new_data = step, optimizer_index, new_data
        self.loss, self.micro, self.guarded = loss, list(micro), guarded
        self.stage = Stage.READY
        self.measurement: Measurement | None = None
        self.measured_before = False  # at a moment before the optimizer step (not inside it)
        self.numbers: Numbers | None = None  # read once, at the decision or the end
        self.decision: Decision | None = None
        self.skipped_by = ""  # "guard" or "scaler"
        self.weights_nonfinite = 0.0  # counted exactly, when the fast check was positive
        self.replayed = False  # its root cause was looked for
        self.found: list[Any] = []  # the monitor's own findings of the step
        # What is said of it, written by the transitions (the stage's facts, read as fields):
        self.ended: Stage | None = None  # how it ended
        self.open = True  # measured (or about to be), not decided: the guard's judge decides it
        self.applied = False  # the optimizer's update stands
        self.skipped = False  # its update did not happen: withheld, undone, or the scaler's skip
        self.reason = ""  # why the guard withheld it (`stabilizer.step.guard.decide`)
        self.checked = False  # its numbers were taken (an unmeasured step is checked by nothing)
        self.weights_bad = False  # the exact count found values turned non-finite

    def _move(self, to: Stage, *allowed: Stage) -> None:
        if self.stage not in allowed:
            raise StageError(f"step {self.step}: {self.stage.value} -> {to.value}")
        self.stage, self.open = to, to in (Stage.READY, Stage.MEASURED)
        if to in _ENDED:
            self.ended = to
            self.applied, self.skipped = to is Stage.STEPPED, to in (Stage.SKIPPED, Stage.REVERTED)

    # --- the transitions, in order ----------------------------------------------------------

    def measure(self, measurement: Measurement, before: bool) -> None:
        """READY -> MEASURED: its numbers are on their way to the host (`before`: at a moment
        before the optimizer step, so code may run between)."""
        self._move(Stage.MEASURED, Stage.READY)
        self.measurement, self.measured_before = measurement, before

    def decide(self, decision: Decision) -> None:
        """MEASURED -> DECIDED: the guard's decision, inside ``optimizer.step``."""
        self._move(Stage.DECIDED, Stage.MEASURED)
        self.decision, self.reason = decision, decision.reason

    def stepped(self) -> None:
        """DECIDED -> STEPPED: the optimizer ran."""
        self._move(Stage.STEPPED, Stage.DECIDED)

    def skip(self, by: str) -> None:
        """DECIDED -> SKIPPED (the guard withheld it), or MEASURED -> SKIPPED (the grad scaler
        found inf/NaN and never called the optimizer): `by` whom."""
        self._move(Stage.SKIPPED, Stage.DECIDED, Stage.MEASURED)
        self.skipped_by = by

    def revert(self) -> None:
        """STEPPED -> REVERTED: its result was non-finite, and the copy was put back."""
        self._move(Stage.REVERTED, Stage.STEPPED)

    def abandon(self) -> None:
        """READY or MEASURED -> ABANDONED: the block ended; the optimizer never ran."""
        self._move(Stage.ABANDONED, Stage.READY, Stage.MEASURED)

    def report(self) -> None:
        """How it ended -> REPORTED."""
        self._move(Stage.REPORTED, *_ENDED)

    def let_go(self) -> None:
        """Its block ended: the loss tensor, the micro-batches (a replay's inputs) and the
        probe's view of the gradients are let go; its numbers are on the host already."""
        self.loss, self.micro = None, []
        probe = self.measurement.probe if self.measurement is not None else None
        if probe is not None:
            probe.forget()

    # --- what was checked of it ----------------------------------------------------------------

    def read(self) -> Numbers | None:
        """Its numbers on the host (the step's one host read, done once)."""
        if self.numbers is None and self.measurement is not None:
            self.numbers = self.measurement.read()
            self.checked = self.numbers is not None
        return self.numbers

    def count_weights(self, count: float) -> None:
        """The exact count of values among the weights, optimizer state and buffers that
        turned non-finite (a sync, on a suspect or skipped step only)."""
        self.weights_nonfinite, self.weights_bad = count, count > 0

    # --- what is said of it, read from the stage ---------------------------------------------

    @property
    def bad(self) -> bool:
        """Non-finite or not checked: counts towards ``stop_after`` (a grad scaler's overflow
        does not: it is the scaler's normal business)."""
        numbers = self.numbers
        if numbers is None or self.weights_bad:
            return True
        if self.reason == STEPPING_PAST:
            return False  # `auto`'s own skip: its numbers are reported, not counted
        loss_bad = numbers.loss is not None and not math.isfinite(numbers.loss)
        scaled = self.measurement is not None and self.measurement.scaled
        grads_bad = numbers.nonfinite_grads > 0 and not scaled
        return loss_bad or grads_bad or self.reason in _BAD_REASONS

    def values(self) -> dict[str, float] | None:
        """The step record's values (None when it could not be measured), float32-rounded as
        TensorBoard keeps them (replay parity); its numbers read if they were not yet."""
        m, numbers = self.measurement, self.read()
        if m is None or numbers is None:
            return None
        values = {k: _f32(v) for k, v in zip(m.grad_keys, numbers.grads, strict=True)}
        for key in m.gradless:  # no gradient is not a zero gradient
            del values[key]
        # The host scales the loss by the grad scaler's scale before handing it over.
        scale = _f32(numbers.scale)
        if numbers.loss is not None:
            loss = _f32(numbers.loss)
            values[LOSS] = float(np.float32(loss / scale)) if m.scaled else loss
        values.update((_lr_key(i), lr) for i, lr in enumerate(m.lrs) if lr is not None)
        if m.scaled:
            values[LOSS_SCALE] = scale
        if m.clip:
            values[CLIP_VAL] = m.clip
            values[CLIPPED] = float(values[GRAD_NORM] > m.clip)
        values.update(zip(m.act_keys, map(_f32, numbers.acts), strict=True))
        if self.guarded or m.scaled:
            values[SKIPPED] = float(self.skipped)
        if self.guarded:
            values[NONFINITE_WEIGHTS] = self.weights_nonfinite
        if self.ended is Stage.REVERTED:
            values[NONFINITE_UPDATE] = 1.0
        if self.new_data:
            values[NEW_DATA] = 1.0
        return values

    def guard_values(self) -> dict[str, float]:
        """What the guard decides on: the total norm, the non-finite count and the loss (when
        a backward ran); empty when the step could not be measured. Its numbers are read here,
        at the decision (the step's one host read, where a policy decides)."""
        numbers = self.read()
        if numbers is None:
            return {}
        values = {GRAD_NORM: numbers.grad_norm, NONFINITE_GRADS: numbers.nonfinite_grads}
        if numbers.loss is not None:
            values[LOSS] = numbers.loss
        return values


def _lr_key(group: int) -> str:
    """The logged key of a param group's LR: ``lr`` for the first, then ``lr/pg2``, ``lr/pg3`` …

    Numbered from 1 as Lightning's ``LearningRateMonitor`` numbers them (its ``pg1`` is ``lr``).
    """
    return LR if group == 0 else f"{LR}/pg{group + 1}"


def _f32(value: float) -> float:
    """`value` rounded to float32, where float32 holds it (a finite 1e300 stays finite)."""
    return float(np.float32(value)) if abs(value) <= _F32_MAX else value


def parameters(optimizers: Sequence[torch.optim.Optimizer]) -> Iterator[torch.Tensor]:
    """What `optimizers` update: every parameter of their groups."""
    return (p for opt in optimizers for group in opt.param_groups for p in group["params"])


class InFlight:
    """The block in flight: its micro-batches, the losses backpropagated, and the steps opened
    in it (one per ``optimizer.step``; several optimizers each their own).

    A block is what its host calls one step: Lightning's batch (or its accumulation window), a
    plain loop's ``with stab.step()``, the HF Trainer's step. It ends at the host's moment
    (`end`); a step still open then was never run by its optimizer.
    """

    def __init__(self) -> None:
        self.micro: list[MicroBatch] = []
        self.keep_batches = False  # keep each micro-batch's inputs (for a root-cause replay)
        self.steps: list[OptimizerStep] = []  # opened in this block, in order
        self._open: dict[int, OptimizerStep] = {}  # by optimizer id, until decided or ended
        self._losses: list[torch.Tensor] = []  # backpropagated since the last step opened
        self._last: torch.Tensor | None = None  # the last step's loss, within this block
        self.params: Callable[[], Iterable[torch.Tensor]] = tuple  # what the optimizers update
        self._carried: Carried | None = None  # left by blocks that stepped nothing, unsettled
        self._carried_micro = self._carried_losses = 0  # how many of each are theirs
        self._dropped: list[OptimizerStep] = []  # theirs, abandoned: ended with this block

    def begin(self, batch: Any, index: int, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
        """A micro-batch starts (`optimizers`: the host's, now); True when it is the first of
        its block. What a replay needs (its batch, the random state, the ``requires_grad``
        flags of what the optimizers update) is kept only where a root cause may replay it."""
        first = not self.micro
        if self.keep_batches:
            trainable = tuple((p, p.requires_grad) for p in parameters(optimizers))
            self.micro.append(MicroBatch(batch, index, RngState.capture(), trainable))
        else:
            self.micro.append(MicroBatch(None, index, None))
        return first

    def add_loss(self, loss: torch.Tensor) -> None:
        """A backward is about to run on `loss` (divided by the accumulation, under it)."""
        loss = loss.detach().to(wide_dtype(loss.device))  # a finite 1e300 (64-true) stays finite
        self._settle()
        if self._losses and not any(p.grad is not None for p in self.params()):
            self.micro, self._losses = let_go(self.micro, self._losses)  # (SAM's first pass)
        self._losses.append(loss)
        if self.micro:
            self.micro[-1].losses.append(loss)

    def current(self, optimizer: torch.optim.Optimizer) -> OptimizerStep | None:
        """The step of `optimizer` opened in this block and not decided yet, if any."""
        step = self._open.get(id(optimizer))
        return step if step is not None and step.open else None

    def of(self, optimizer: torch.optim.Optimizer) -> OptimizerStep | None:
        """The step of `optimizer` opened in this block, whatever its stage."""
        return self._open.get(id(optimizer))

    def open(
        self,
        optimizer: torch.optim.Optimizer,
        step: int,
        index: int,
        *,
        new_data: bool = False,
        guarded: bool = False,
    ) -> OptimizerStep:
        """A new step of `optimizer` (READY): the losses since the last step are its loss (a
        second optimizer stepping on the same backward shares the last one's), with those of
        earlier blocks whose gradients it takes (`Carried`). A second step of one optimizer at
        a host's step that did not advance (a plain loop's block) is the step after it."""
        if (earlier := self._open.get(id(optimizer))) is not None:
            step = max(step, earlier.step + 1)
        self._settle()
        if self._losses:  # (summed in order: the micro-batches' shares of the step's loss)
            self._losses, self._last = [], sum(self._losses[1:], self._losses[0])
        opened = OptimizerStep(step, index, self._last, self.micro, new_data, guarded)
        self.steps.append(opened)
        self._open[id(optimizer)] = opened
        return opened

    def end(self, step: int, carry: bool) -> list[OptimizerStep]:
        """The block is over: each step still open ends — skipped by the grad scaler (measured
        non-finite under it: the scaler never called the optimizer) or abandoned. A block that
        backpropagated without opening a step leaves its gradients, loss and micro-batches to
        the next step that takes them (manual accumulation), or, when they were zeroed first,
        is abandoned as a step of its own (at `step`, `Carried`); with `carry`, a block that
        opened no step holds them for the next whatever happens (Lightning's automatic
        accumulation, which never zeroes between). Returns the block's ended steps."""
        if not self.steps and carry:
            return []
        self._settle()
        dropped, self._dropped = self._dropped, []
        if not self.steps and self._losses:  # its gradients stay for the next step (`Carried`)
            self._carried = Carried(self.params(), step)
            self._carried_micro, self._carried_losses = len(self.micro), len(self._losses)
            return dropped
        self.steps[:0] = dropped
        for step_ in self.steps:
            if step_.open:
                _close(step_)
            step_.let_go()
        steps, self.steps = self.steps, []
        self.micro, self._open, self._losses, self._last = [], {}, [], None
        self._carried = None
        return steps

    def _settle(self) -> None:
        """Before anything may write the gradients earlier blocks left (a backward, a step,
        the block's end): carried into the coming step, or, zeroed since, abandoned as a step
        of their own (`Carried`)."""
        carried, self._carried = self._carried, None
        if carried is None or not carried.zeroed():
            return
        k, j = self._carried_micro, self._carried_losses
        dropped = OptimizerStep(carried.step, 0, None, self.micro[:k])
        dropped.abandon()
        dropped.let_go()
        self._dropped.append(dropped)
        self.micro, self._losses = self.micro[k:], self._losses[j:]


def _close(step: OptimizerStep) -> None:
    """A step its optimizer never ran: the grad scaler's skip, or abandoned."""
    m = step.measurement
    if step.stage is Stage.MEASURED and m is not None and m.scaled:
        numbers = step.read()
        if numbers is not None and numbers.nonfinite_grads > 0:
            step.skip("scaler")
            return
    step.abandon()
