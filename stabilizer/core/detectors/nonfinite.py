"""`NonFinite`: NaN or Inf in the loss or the gradients, reported at the step it appears."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

from stabilizer.core import kinds
from stabilizer.core.records import Finding, Severity, StepRecord
from stabilizer.core.remedies import MIXED_PRECISION, ROLLBACK, UPCAST_TO_FP32
from stabilizer.core.run import RunHeader
from stabilizer.core.signals import (
    GRAD_NORM,
    GRAD_NORM_PREFIX,
    LOSS,
    LOSS_SCALE,
    NONFINITE_GRADS,
    NONFINITE_UPDATE,  # the signal (1.0 when the update made finite weights non-finite)
    SKIPPED,
)

from ._consequence import Probe
from .base import check_at_least
from .overflow_risk import computes_in_fp16

__all__ = ["NonFinite"]

_FLOOR_LOSS = -math.log(1.1754943508222875e-38)  # -ln(FLT_MIN) = 87.3365: log(0) clamped
_QUIET_BELOW = 0.5 * _FLOOR_LOSS  # a loss under it is no multiple of the floor (`_quiet`)
_FLOORED = 3  # losses at the floor in a row that are a NaN in disguise with no lower one before
_ZEROS = 3  # losses of exactly 0 in a row ...
_FELL = 0.5  # ... right after one of at least this much: a NaN the HF Trainer printed as 0.0
_FP32 = "run LayerNorm/softmax in fp32"
_MASTER = "keep fp32 master weights (16-mixed) or raise the optimizer's eps"


class NonFinite:
    """A NaN or Inf loss or gradient, and whether the run recovers from it.

    Requires: ``loss``, ``grad_norm``, ``grad_norm/<group>`` or ``nonfinite_grads``;
    ``nonfinite_update`` where the live guard undid a step that made the weights non-finite.
    Rule: a NaN/Inf loss or gradient → ERROR at once; CRITICAL after `persistent_after` in a row.

    An episode is a run of consecutive non-finite records. Its first step is reported immediately
    (zero lag: a live guard must skip that very step) as ``nonfinite_loss`` when the loss is
    non-finite, else ``nonfinite_grad`` with the non-finite depth groups as location. When the
    episode reaches `persistent_after` records a CRITICAL finding says the run is not recovering;
    it is emitted right then, not at the episode's end, because a NaN that persists never ends.
    Such an episode gets a closing finding with the same start: INFO at the first finite record,
    CRITICAL "until the end of the log" when the stream ends first.

    An fp16 grad scaler overflow (``loss_scale`` present, ``skipped`` = 1, finite loss) is the
    scaler doing its job: the step was skipped and nothing non-finite reached the weights, so
    non-finite gradients are left to `Fp16Overflow` there. A non-finite loss is always reported.

    Finite loss and gradients with ``nonfinite_update`` = 1 mean the optimizer itself produced the
    NaN/Inf (AdamW's ``eps`` underflowing in fp16): ``nonfinite_update``, located at the optimizer.

    A loss pinned at ``-ln(FLT_MIN)`` = 87.3365 (or a whole multiple: Caffe prints the loss times
    its ``loss_weight``), the same value twice running after a lower loss, is a NaN in disguise:
    every probability underflowed to 0 and the softmax loss clamps log(0) there. An excerpt that
    begins there shows no lower loss: three records running at it say the same (sphereface#103:
    87.3365 on every record; a batch's mean loss is not that number to the printed digit three
    times unless every sample's probability is 0). So is a loss of
    exactly 0 for the third record running right after a loss of 0.5 or more: no loss falls to
    exactly 0 at once, and the HF Trainer prints 0.0 for a logging window whose every loss was
    NaN/Inf (Qwen-VL#352 in fp16: 3.85, then 0.0 on every record; a loss that is 0 from the first
    record, as GRPO's early on, is no such fall). Both are reported as a non-finite loss, not read
    as a plateau.

    Args:
        persistent_after: Consecutive non-finite records after which the run counts as stuck.
    """

    name: ClassVar[str] = "nonfinite"
    requires: ClassVar[tuple[str, ...]] = (LOSS, GRAD_NORM, GRAD_NORM_PREFIX, NONFINITE_GRADS)

    def __init__(self, persistent_after: int = 5) -> None:
        check_at_least("persistent_after", persistent_after, 2)
        self.persistent_after = persistent_after
        self._start: int | None = None  # first step of the open episode
        self._last = 0  # last step of the open episode
        self._length = 0  # non-finite records in the open episode
        self._loss_seen = False  # whether the open episode had a non-finite loss
        self._optimizer_only = False  # whether only the optimizer went non-finite in it
        self._lowest = math.inf  # the lowest finite loss seen
        self._previous: float | None = None  # the loss of the record before
        self._zeros = 0  # losses of exactly 0 in a row
        self._floored = 0  # records in a row at the same multiple of the floor, after the first
        self._before_zeros = 0.0  # the loss before them
        self._fp16: bool | None = None  # whether the run computes in fp16 (None: not known)
        self._probe = Probe()  # a first non-finite gradient norm held until the next record

    def set_run(self, run: RunHeader) -> None:
        """What the run is: AdamW's eps underflows to 0 only where it computes in fp16."""
        self._fp16 = computes_in_fp16(run.precision)

    def update(self, record: StepRecord) -> list[Finding]:
        values = record.values
        if self._quiet(values):
            return []  # (most records)
        if not (LOSS in values or GRAD_NORM in values or NONFINITE_GRADS in values) and not any(
            key.startswith(GRAD_NORM_PREFIX) for key in values
        ):
            return []
        loss, prior = values.get(LOSS), self._previous  # (`_pinned` moves `_previous` on)
        bad_loss = loss is not None and (not math.isfinite(loss) or self._pinned(loss))
        scaler_skip = LOSS_SCALE in values and (values.get(SKIPPED) or 0.0) >= 0.5
        # A finite sum means every value is finite: no gradient group to look for (most records).
        everything_finite = math.isfinite(sum(values.values()))
        if scaler_skip or (everything_finite and not values.get(NONFINITE_GRADS)):
            groups: tuple[str, ...] = ()
        else:
            groups = _bad_groups(values)
        if not (bad_loss or groups) and (values.get(NONFINITE_UPDATE) or 0.0) >= 0.5:
            groups = ("optimizer",)
        if not (bad_loss or groups):
            if self._probe.held is None and not self._probe.recent:
                return self._end(record.step)  # (most records)
            return self._finite(record.step, loss)
        self._length, self._last = self._length + 1, record.step
        self._loss_seen = self._loss_seen or bad_loss
        only_optimizer = groups == ("optimizer",)
        self._optimizer_only = only_optimizer and (self._start is None or self._optimizer_only)
        if self._start is None:
            self._start = record.step
            first = self._first(record.step, loss if bad_loss else None, groups)
            if not (bad_loss or only_optimizer) and self._probe.may_hold(loss, self._fp16):
                assert loss is not None
                band = loss if prior is None else max(loss, prior)
                self._probe.hold(first, band)  # judged by the next record (`_consequence`)
                return []
            return [first]
        found = [] if self._probe.held is None else [self._probe.held]  # it repeats: held stands
        self._probe.held = None
        if self._length == self.persistent_after:
            found.append(self._persistent(f"for {self._span()}", Severity.CRITICAL))
        return found

    def _finite(self, step: int, loss: float | None) -> list[Finding]:
        """A finite record: it settles a held non-finite gradient norm (`Probe.judge`) and ends
        the open episode."""
        probe = self._probe
        if probe.held is None:
            probe.recent -= 1
            return self._end(step)
        return [probe.judge(loss, step), *self._end(step)]

    def _quiet(self, values: Mapping[str, float]) -> bool:
        """Whether a record needs nothing but noting its loss (then noted): every value finite,
        no count of non-finite gradients or updates, a loss above 0 and far under the floor,
        nothing open or held. What the rest of `update` would conclude of it, without the
        rest's work (most records are such)."""
        loss = values.get(LOSS)
        if not (
            loss is not None
            and 0.0 < loss < _QUIET_BELOW
            and self._start is None
            and not self._zeros
            and self._probe.held is None
            and not self._probe.recent
            and math.isfinite(sum(values.values()))
            and not values.get(NONFINITE_GRADS)
            and not values.get(NONFINITE_UPDATE)
        ):
            return False
        self._previous, self._floored = loss, 0  # (`_pinned`'s bookkeeping, as it would do)
        if loss < self._lowest:
            self._lowest = loss
        return True

    def _pinned(self, loss: float) -> bool:
        """Whether a finite loss is a NaN in disguise: pinned at a multiple of ``-ln(FLT_MIN)``,
        or exactly 0 for the `_ZEROS`-th record running right after a loss of `_FELL` or more
        (class docstring)."""
        previous, self._previous = self._previous, loss
        lowest, self._lowest = self._lowest, min(self._lowest, loss)
        if loss == 0.0:
            if not self._zeros:
                self._before_zeros = previous or 0.0
            self._zeros += 1
            return self._zeros >= _ZEROS and self._before_zeros >= _FELL
        if self._zeros:
            self._zeros = 0
        weight = round(loss / _FLOOR_LOSS)
        if loss != previous or weight < 1 or abs(loss - weight * _FLOOR_LOSS) > 1e-5 * loss:
            self._floored = 0
            return False
        self._floored += 1
        return lowest < loss or self._floored >= _FLOORED - 1

    def _end(self, step: int) -> list[Finding]:
        """A finite record: the open episode, if any, is over; one of several records says so:
        its first and last step and how many (the first finding named only the first)."""
        found = []
        if self._start is not None and self._length > 1:
            kind, what, _ = self._what()
            seen = (
                f"{what} finite again at step {step} after {self._span('non-finite ')} since "
                f"step {self._start}"
            )
            remedies: tuple[str, ...] = ()
            if self._length < self.persistent_after:  # (the persistent one said it all)
                seen = f"{what} non-finite at steps {self._start}-{self._last} ({self._span()}), "
                seen += f"finite again at step {step}"
                remedies = kinds.kind_of(kind).remedies
            finding = Finding(
                kind=kind,
                step=self._start,
                end_step=self._last,
                severity=Severity.INFO,
                seen=seen,
                evidence={"steps": float(self._length)},
                remedies=remedies,
            )
            found.append(finding)
        self._start, self._length, self._loss_seen = None, 0, False
        return found

    def _span(self, what: str = "") -> str:
        """``"41 steps"``, or ``"41 records"`` where the log prints one record every N steps."""
        steps = self._start is not None and self._last - self._start + 1 == self._length
        return f"{self._length} {what}{'steps' if steps else 'records'}"

    def _first(self, step: int, loss: float | None, groups: tuple[str, ...]) -> Finding:
        location = tuple(g for g in groups if g != GRAD_NORM)
        evidence = {"nonfinite_groups": float(len(location))}
        if loss is not None:
            evidence["loss"] = loss
            what, kind = f"loss is {loss}", kinds.NONFINITE_LOSS
            if loss == 0.0:
                what = (
                    f"loss is exactly 0 on {self._zeros} records running, right after "
                    f"{self._before_zeros:g} (no loss falls to exactly 0 at once: the HF Trainer "
                    "prints 0.0 for a logging window whose every loss was NaN/Inf)"
                )
            elif math.isfinite(loss):
                what = (
                    f"loss is pinned at {loss:g} ({loss / _FLOOR_LOSS:.0f} x 87.3365 = "
                    "-ln(FLT_MIN): every probability underflowed to 0)"
                )
        elif location == ("optimizer",):
            what, kind = "the optimizer step made finite weights non-finite", kinds.NONFINITE_UPDATE
        else:
            where = f" in {', '.join(location)}" if location else ""
            what, kind = f"gradients are non-finite{where}", kinds.NONFINITE_GRAD
        seen, advice = f"{what} at step {step}", "skip the step; if it recurs, " + _FP32
        if kind == kinds.NONFINITE_UPDATE:
            seen += (
                " (in fp16, AdamW's eps underflows to 0)"
                if self._fp16 is not False
                else " (the optimizer's own arithmetic: an eps of 0, or a gradient so large that "
                "its square overflows)"
            )
            advice = "skip the step; " + _MASTER
        return Finding(
            kind=kind,
            step=step,
            end_step=step,
            severity=Severity.ERROR,
            seen=seen,
            evidence=evidence,
            location=location,
            remedies=kinds.kind_of(kind).remedies,
            advice=advice,
        )

    def _what(self) -> tuple[str, str, str]:
        """The open episode's kind, what went non-finite in it, and the advice."""
        if self._optimizer_only:
            return kinds.NONFINITE_UPDATE, "optimizer updates", _MASTER
        advice = "roll back and " + _FP32
        if self._loss_seen:
            return kinds.NONFINITE_LOSS, "loss", advice
        return kinds.NONFINITE_GRAD, "gradients", advice

    def _persistent(self, span: str, severity: Severity) -> Finding:
        assert self._start is not None
        kind, what, advice = self._what()
        verb = "persists" if what == "loss" else "persist"  # "gradients", "updates"
        # (skipping one more step is no use any more: the NaN persists)
        remedies = (MIXED_PRECISION,) if self._optimizer_only else (ROLLBACK, UPCAST_TO_FP32)
        return Finding(
            kind=kind,
            step=self._start,
            end_step=self._last,
            severity=severity,
            seen=f"NaN/Inf {what} {verb} {span} since step {self._start}: the run is not "
            "recovering",
            evidence={"steps": float(self._length)},
            remedies=remedies,
            advice=advice,
        )

    def restart(self) -> None:
        """Training restarted from a snapshot (`Engine.restart`): the weights that went
        non-finite are gone, so the open episode ends there, its findings standing; a NaN after
        the restart is a new episode (which ``auto`` answers again)."""
        self._start, self._length, self._loss_seen, self._optimizer_only = None, 0, False, False

    def finish(self) -> list[Finding]:
        found = [] if self._probe.held is None else [self._probe.held]  # no next record to judge
        self._probe.held = None
        if self._length >= self.persistent_after:
            span = f"until the end of the log ({self._span()})"
            found.append(self._persistent(span, Severity.CRITICAL))
        elif self._start is not None and self._length > 1:  # a short stretch the log ends in
            kind, what, _ = self._what()
            seen = f"{what} non-finite at steps {self._start}-{self._last} ({self._span()}), "
            seen += "to the end of the log"
            found.append(
                Finding(kind, self._start, self._last, Severity.INFO, seen,
                        {"steps": float(self._length)}, remedies=kinds.kind_of(kind).remedies)
            )  # fmt: skip
        self._start, self._length, self._loss_seen = None, 0, False
        return found

    def state_dict(self) -> dict[str, Any]:
        return {
            "start": self._start,
            "last": self._last,
            "length": self._length,
            "loss_seen": self._loss_seen,
            "optimizer_only": self._optimizer_only,
            "lowest": None if self._lowest == math.inf else self._lowest,
            "previous": self._previous,
            "zeros": [self._zeros, self._before_zeros],
            "floored": self._floored,
            "probe": self._probe.state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._start, self._length = state["start"], int(state["length"])
        self._last = int(state.get("last", self._start or 0))
        self._loss_seen = bool(state["loss_seen"])
        self._optimizer_only = bool(state.get("optimizer_only", False))
        lowest = state.get("lowest")
        self._lowest = math.inf if lowest is None else float(lowest)
        previous = state.get("previous")
        self._previous = None if previous is None else float(previous)
        self._probe.load(state.get("probe"))  # absent in checkpoints of earlier rounds
        zeros, before = state.get("zeros", (0, 0.0))
        self._zeros, self._before_zeros = int(zeros), float(before)
        self._floored = int(state.get("floored", 0))


def _bad_groups(values: Mapping[str, float]) -> tuple[str, ...]:
    """The non-finite gradient signals: ``grad_norm`` and the groups of ``grad_norm/<group>``."""
    bad = [
        key.removeprefix(GRAD_NORM_PREFIX)
        for key, value in values.items()
        if (key == GRAD_NORM or key.startswith(GRAD_NORM_PREFIX)) and not math.isfinite(value)
    ]
    count = values.get(NONFINITE_GRADS)
    if count is not None and (not math.isfinite(count) or count > 0) and not bad:
        bad.append(GRAD_NORM)
    return tuple(bad)
