"""The cause of a finding as the reports say it: what the incident's evidence and the run's log
tell (a NaN made in the loss, an fp32 run, no fp16).

A kind's title, usual cause and remedies are its row in `stabilizer.core.kinds`; which remedies
fit the run, and each remedy's action in words, are `stabilizer.core.advice` (every output's
one rule); here is what the reports add to the usual cause.
"""

from __future__ import annotations

from collections.abc import Sequence

from stabilizer.core.advice import RunFacts, in_the_loss
from stabilizer.core.kinds import LOSS_SPIKE, Kind, kind_of
from stabilizer.core.records import Finding

__all__ = ["advice_for", "cause_for"]


_LOSS_CAUSE = (
    "the loss computation or its inputs: every module output was finite, so look at the loss "
    "itself (a log of 0, a division by a count of 0, NaN labels or loss weights)"
)


def cause_for(
    kind: str, findings: Sequence[Finding], facts: RunFacts, recovered: bool | None = None
) -> str:
    """The usual cause of ``kind``, as far as the incident's evidence, its outcome (``recovered``,
    as the report's outcome says it: None when it says nothing) and the run tell."""
    row = kind_of(kind)
    if row.nan and in_the_loss(findings):
        return _LOSS_CAUSE
    if facts.low_precision is False and row.cause_fp32:
        return row.cause_fp32
    if not facts.fp16 and row.cause_not_fp16:
        return row.cause_not_fp16
    if kind == LOSS_SPIKE:
        return _spike_cause(next(f for f in findings if f.kind == kind), recovered)
    return row.cause


def _spike_cause(spike: Finding, outcome: bool | None) -> str:
    """A loss spike's cause as its evidence (and the outcome, where the report says one)
    tells: one step up or several, recovered or not."""
    if spike.end_step is None or spike.end_step == spike.step:
        cause = "one batch with an outsized gradient pushed the weights off course"
    else:  # (a log may not hold every step: the span, not a count of bad steps)
        cause = (
            f"the loss stayed up from step {spike.step} to {spike.end_step}, not for one step: "
            "a run of bad batches (corrupt or mislabelled data, a bad shard), or one outsized "
            "update the weights took that long to undo"
        )
    recovered = spike.evidence.get("recovered", 1.0) >= 0.5 if outcome is None else outcome
    return cause + ("; the run recovered" if recovered else "; not back by the end of the log")


def advice_for(kind: str) -> Kind:
    """The row of a finding kind (title, cause, ...); an unknown kind gets its own name and a
    neutral cause."""
    return kind_of(kind)
