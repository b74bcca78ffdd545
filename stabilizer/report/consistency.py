"""Where a report's sentences about the same steps meet, the log's own record wins.

A report speaks of a run's steps in several places: each finding's own words (``back after 1
step``), the outcome line (``never recovers: the loss is non-finite from step 51 ...``), the cause
(``...; the run recovered``), the remedies (a rollback is no advice after a recovery) and the
verdict (``segment 2 ... is clean``). They are made from different evidence: a detector saw the
loss come back below its band, the log shows the loss non-finite from a step to its end. Where
they meet, the log's own record wins (`refuted`): an HF Trainer logs a NaN loss as ``0.0``, which
a spike detector takes for the loss come back; the loss non-finite to the end says it never did.
Every sentence on recovery is then made from that one answer (`Incident.recovered`), and the
finding's own words are kept with what the log shows beside them (`what`).

`stabilizer.report.check` then reads each rendered report for what still disagrees.
"""

from __future__ import annotations

from collections.abc import Sequence

from stabilizer.core.records import Finding
from stabilizer.replay.diagnose import Segment

__all__ = ["came_back", "refuted", "what"]

_RECOVERY = "recovery_steps"  # the evidence of a finding that says the loss came back


def came_back(findings: Sequence[Finding]) -> int | None:
    """The first step at which a finding says the loss came back (None: none says so)."""
    steps = [f.step + int(f.evidence[_RECOVERY]) for f in findings if _RECOVERY in f.evidence]
    return min(steps, default=None)


def refuted(findings: Sequence[Finding], segment: Segment) -> int | None:
    """The step from which the log shows the loss non-finite to the end of ``segment``, when
    that is where (or before) the findings say the loss came back: then it never did."""
    back, since = came_back(findings), segment.nonfinite_since
    return since if back is not None and since is not None and since <= back else None


def what(finding: Finding, segment: Segment, where: str) -> str:
    """A finding's own words, and, where the log refutes the loss it says came back, what the
    log shows (``"..., back after 1 step; but the loss is non-finite from step 51 to the end
    of the log"``)."""
    text = finding.observation
    since = refuted([finding], segment)
    if since is None:
        return text
    return f"{text}; but the loss is non-finite from step {since} to the end of the {where}"
