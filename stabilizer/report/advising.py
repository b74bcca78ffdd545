"""The findings of a diagnosis as the outputs show them: each advised as its incident and the
run's facts fit it, by the one rule of `stabilizer.core.advice`.

The text and markdown reports and the verdict advise an incident (`Incident.remedies`); the JSON
report and the TensorBoard export show findings one by one, and advise each with the facts and
the incident (its other findings, its outcome) that the incident's advice has, so that every
output says the same. ``stabilizer watch`` advises a finding as it comes (`advise_now`): with
the facts so far and the findings just before it; how its episode ends is not known yet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from stabilizer.core.advice import advised
from stabilizer.core.episode import EpisodeStart, episode_start, fold_updates
from stabilizer.core.records import Finding
from stabilizer.replay.diagnose import Diagnosis, diagnose
from stabilizer.replay.readers import LogReadError

from .incidents import Incident, incidents, run_facts

__all__ = ["RECENT", "Adviser", "advise_now", "advised_run", "adviser"]

RECENT = 64
"""Findings before a new one that `advise_now` looks at for its context (its step's root cause)."""

Adviser = Callable[[int, Finding], Finding]
"""A finding of segment ``n`` (1-based) as the outputs show it."""


def adviser(diagnosis: Diagnosis) -> Adviser:
    """What advises the findings of ``diagnosis`` (as it stands: `watch` asks again later)."""
    found: dict[tuple[int, EpisodeStart], Incident] = {}  # the incident of each episode
    for incident in incidents(diagnosis):
        for finding in incident.findings:
            found.setdefault((incident.segment, episode_start(finding)), incident)

    def advise(segment: int, finding: Finding) -> Finding:
        incident = found.get((segment, episode_start(finding)))
        if incident is None:  # set-up advice: no incident
            return advised(finding, run_facts(diagnosis, segment))
        return advised(finding, incident.facts, incident.findings, recovered=incident.recovered)

    return advise


def advise_now(diagnosis: Diagnosis, segment: int, finding: Finding) -> Finding:
    """``finding``, just found, as the outputs show it: the run's facts so far, and as context
    the latest findings of its segment that reach its step (a NaN's root cause, the overflow
    cascade it is part of); a bounded look, so a watch of a log with thousands of findings
    stays linear."""
    recent = [
        item.finding
        for item in diagnosis.findings[-RECENT:]
        if item.segment == segment and (item.finding.end_step or item.finding.step) >= finding.step
    ]
    return advised(finding, run_facts(diagnosis, segment), recent)


def advised_run(findings: Sequence[Finding], jsonl: Path) -> list[Finding]:
    """A finished live run's findings, one per episode, advised from its ``stability.jsonl``
    as ``diagnose`` advises them (the run's precision, the steps skipped, how each episode
    ended): the demo's summary. As found when the log cannot be read."""
    found = fold_updates(findings)
    try:
        advise = adviser(diagnose(str(jsonl)))
    except (LogReadError, OSError):
        return found
    return [advise(1, finding) for finding in found]
