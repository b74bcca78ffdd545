"""The ``auto`` policy checks its work: after each remedy, did the failure it answered go away?

Each applied remedy is watched for `CHECK_STEPS` steps (``AutoRemedies(check_steps=...)``). It
*did not work* when, in that window, the failure it is for comes back: a finding of one of its
`FAILS` kinds (at WARNING or above; ``divergence`` at ERROR) that starts after the remedy, or,
for ``swap_to_pre_ln``, a ``depth_imbalance`` band still open at the window's end or a loss that
did not fall (the median of the last `LEVEL` losses not below its median when the swap was made:
the failure it answers is a stack that does not learn). It *worked* only when the numbers say the
run is better off: the loss is finite and, for a failure that shows in the loss (`IN_LOSS`: a
spike, a divergence, a NaN loss), its level at the window's end (the median of the last `LEVEL`
losses) is not above its level before the trouble began (the median of the `LEVEL` finite losses
before the finding's first step) by more than `WORSE` of it. A run whose failure did not come
back but whose loss stayed above that level is *not better*: said so, with the numbers, and left
alone (no further remedy, no stop: nothing failed again). A remedy for a failure of the gradients
(a gradient spike, clipping saturated, a NaN gradient) is judged by that failure alone: the loss
may stand at a new level for reasons of its own (a new stage of training began with the spike).
A remedy that did not work is followed by the next remedy for that finding (`Remedy.next` in the
remedy table), and when none is left by a CRITICAL ``remedy_result`` that says what was tried
and what to do, and a clean stop.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from stabilizer.core.kinds import (
    DEPTH_IMBALANCE,
    DIVERGED,
    DIVERGENCE,
    LOSS_SPIKE,
    NONFINITE_LOSS,
    REMEDY_APPLIED,
    REMEDY_RESULT,
    TABLE,
)
from stabilizer.core.records import Finding, Severity
from stabilizer.core.remedies import SWAP_TO_PRE_LN, remedy

__all__ = [
    "CHECK_STEPS",
    "FAILS",
    "IN_LOSS",
    "LEVEL",
    "Applied",
    "Ladder",
    "Result",
    "Trial",
    "applied_finding",
    "cause_of",
    "result_finding",
    "stop_advice",
]

CHECK_STEPS = 50
"""Steps a remedy is watched for before it is said to have worked."""

IN_LOSS = frozenset({LOSS_SPIKE, DIVERGENCE, DIVERGED, NONFINITE_LOSS})
"""The failures that show in the loss: a remedy for one is judged by the loss level as well."""

LEVEL = 10
"""Losses whose median is a loss level (before the trouble, at a swap, at a verdict)."""

WORSE = 0.05
"""A level more than this share above the one before the trouble is no better (the share of the
level's size: a negative NLL loss is compared on its magnitude)."""

FAILS: dict[str, tuple[str, ...]] = {
    remedy: tuple(kind.name for kind in TABLE if remedy in kind.refutes)
    for remedy in dict.fromkeys(name for kind in TABLE for name in kind.refutes)
}
"""Remedy -> the finding kinds whose return says it did not work (`Kind.refutes`). Clipping is
for spikes that would throw the run off: a loss spike that comes back down (bad data still has a
high loss) is what it lets through, so it refutes nothing; a divergence is what clipping is for."""


@dataclass
class Trial:
    """One applied remedy under watch."""

    remedy: str
    cause: str  # the finding kind it answered
    step: int  # applied after this step
    until: int  # the verdict is due at this step
    loss: float  # the loss when it was applied
    open_bands: set[int] = field(default_factory=set)  # depth_imbalance episodes still open
    level: float = math.nan  # the median of the last `LEVEL` losses when it was applied
    before: float = math.nan  # the loss level before the trouble it answers began


@dataclass
class Result:
    """What became of one watched remedy."""

    watch: Trial
    worked: bool
    loss: float
    because: Finding | None = None
    why: str = ""  # why it did not work, when no finding came back
    failed: bool = True  # (when it did not work) the failure is back: the next remedy is due


class Ladder:
    """Watches applied remedies; says which worked and which did not.

    Args:
        check_steps: Steps each remedy is watched for.
    """

    def __init__(self, check_steps: int = CHECK_STEPS) -> None:
        if check_steps < 1:
            raise ValueError(f"`check_steps` must be >= 1, got {check_steps}")
        self.check_steps = check_steps
        self.watches: list[Trial] = []
        self.tried: list[str] = []  # remedies applied, in order
        self._recent: deque[float] = deque(maxlen=LEVEL)  # the last finite losses
        self._history: deque[tuple[int, float]] = deque(maxlen=1000)  # (step, finite loss)

    def watch(self, remedy: str, cause: Finding, step: int, loss: float) -> None:
        """Start watching `remedy`, applied after `step` for `cause`."""
        self.tried.append(remedy)
        self.watches = [w for w in self.watches if w.remedy != remedy]  # the newest counts
        bands = {cause.step} if cause.kind == DEPTH_IMBALANCE else set()
        watch = Trial(remedy, cause.kind, step, step + self.check_steps, loss, bands)
        watch.level = self._level()
        earlier = [x for s, x in self._history if s < cause.step][-LEVEL:]
        watch.before = statistics.median(earlier) if earlier else math.nan
        self.watches.append(watch)

    def check(self, step: int, found: Sequence[Finding], loss: float) -> list[Result]:
        """The verdicts due at `step`, given the step's findings and loss."""
        if math.isfinite(loss):
            self._recent.append(loss)
            self._history.append((step, loss))
        verdicts, kept = [], []
        for w in self.watches:
            _track_bands(w, found)
            back = next((f for f in found if _fails(w, f)), None)
            if back is not None:
                verdicts.append(Result(w, False, loss, back))
            elif step >= w.until:
                verdicts.append(self._at_the_end(w, loss))
            else:
                kept.append(w)
        self.watches = kept
        return verdicts

    def _level(self) -> float:
        return statistics.median(self._recent) if self._recent else math.nan

    def _at_the_end(self, w: Trial, loss: float) -> Result:
        if w.open_bands:
            return Result(w, False, loss, why="the band of starved blocks is still there")
        level = self._level()
        if w.remedy == SWAP_TO_PRE_LN and level >= w.level:  # (NaN: no level to compare)
            why = f"the loss did not fall (median of the last {LEVEL}: "
            return Result(w, False, loss, why=f"{why}{_num(w.level)} -> {_num(level)})")
        if not math.isfinite(loss):
            return Result(w, False, loss, why="the loss is not finite")
        if w.cause in IN_LOSS and level > w.before + WORSE * abs(w.before):  # (NaN: no level)
            why = (
                f"the run is not better: its loss level is {_num(level)}, it was "
                f"{_num(w.before)} before the trouble (median of {LEVEL} losses)"
            )
            return Result(w, False, loss, why=why, failed=False)
        return Result(w, True, loss)

    def state_dict(self) -> dict[str, object]:
        return {"tried": list(self.tried)}

    def load_state_dict(self, state: dict[str, object]) -> None:
        tried = state.get("tried", [])
        self.tried = [str(t) for t in tried] if isinstance(tried, list) else []


def _track_bands(w: Trial, found: Sequence[Finding]) -> None:
    if w.remedy != SWAP_TO_PRE_LN:
        return
    for f in found:
        if f.kind == DEPTH_IMBALANCE:
            if f.severity <= Severity.INFO:
                w.open_bands.discard(f.step)
            else:
                w.open_bands.add(f.step)


def _fails(w: Trial, f: Finding) -> bool:
    if f.kind not in FAILS.get(w.remedy, ()) or f.step <= w.step:
        return False
    if f.kind == DEPTH_IMBALANCE:
        return False  # judged at the window's end: the band must have closed
    # (a divergence is an ERROR, and INFO once the loss is back: only the ERROR counts)
    return f.severity >= Severity.WARNING


@dataclass
class Applied:
    """A remedy `auto` applied: its name, what it did in words, the numbers before and after."""

    name: str
    message: str
    evidence: dict[str, float]


def applied_finding(step: int, cause: Finding, applied: Applied) -> Finding:
    """The ``remedy_applied`` finding of `applied`, answering `cause`."""
    return Finding(
        kind=REMEDY_APPLIED, step=step, end_step=step, severity=Severity.INFO,
        seen=f"{applied.name} after {cause.kind} (step {cause.step}): {applied.message}",
        evidence=applied.evidence, location=cause.location, remedies=(applied.name,),
    )  # fmt: skip


def cause_of(verdict: Result) -> Finding:
    """A stand-in for the finding a failed remedy answered, when none came back."""
    w = verdict.watch
    return Finding(
        kind=w.cause, step=w.step, end_step=w.step, severity=Severity.WARNING,
        seen=f"{w.remedy} did not work",
    )  # fmt: skip


def result_finding(
    step: int, verdict: Result, next_remedy: str | None, tried: Sequence[str]
) -> Finding:
    """The ``remedy_result`` finding of `verdict`; `next_remedy` is what comes next (None: a
    stop, when the remedy did not work); `tried`: the remedies applied so far."""
    w = verdict.watch
    evidence = {"loss_before": w.loss, "loss_after": verdict.loss, "applied_step": float(w.step)}
    evidence.update(worked=float(verdict.worked), level_before_trouble=w.before)
    head = f"{w.remedy} (after {w.cause}, step {w.step})"
    numbers = f"loss {_num(w.loss)} -> {_num(verdict.loss)}"
    severity, remedies = Severity.INFO, [w.remedy]
    if verdict.worked:
        seen = f"{head} worked: no {w.cause} back in {w.until - w.step} steps; {numbers}"
    else:
        why = (
            f"{verdict.because.kind} at step {verdict.because.step}"
            if verdict.because is not None
            else verdict.why
        )
        seen = f"{head} did not work: {why}; {numbers}"
        if not verdict.failed:
            severity = Severity.WARNING
            seen += "; the failure did not come back: nothing more applied"
        elif next_remedy is not None:
            severity, remedies = Severity.WARNING, [w.remedy, next_remedy]
            seen += f"; next: {next_remedy}"
        else:
            severity = Severity.CRITICAL
            seen += f"; nothing left: stopping the run ({stop_advice(tried, w.remedy)})"
    return Finding(
        kind=REMEDY_RESULT, step=step, end_step=step, severity=severity, seen=seen,
        evidence=evidence, remedies=tuple(remedies),
    )  # fmt: skip


def stop_advice(tried: Sequence[str], last: str) -> str:
    """``tried clip_gradients, rollback; restart ...``: for the CRITICAL result's message."""
    return f"tried {', '.join(dict.fromkeys(tried))}; {remedy(last).last_resort}"


def _num(x: float) -> str:
    return f"{x:.4g}"
