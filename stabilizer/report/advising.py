"""The findings of a diagnosis as the outputs show them: each advised as its episode and the
run's facts fit it, by the one rule of `stabilizer.core.advice`.

The text and markdown reports and the verdict advise an episode (`Episode.remedies`); the JSON
report, the TensorBoard export and ``stabilizer watch`` show findings one by one, and advise
each with the facts and the episode (its other findings, its outcome) that the episode's
advice has, so that every output says the same.
"""

from __future__ import annotations

from collections.abc import Callable

from stabilizer.core.advice import advised
from stabilizer.core.records import Finding
from stabilizer.replay.diagnose import Diagnosis

from .episodes import Episode, episodes, run_facts

__all__ = ["Adviser", "adviser"]

Adviser = Callable[[int, Finding], Finding]
"""A finding of segment ``n`` (1-based) as the outputs show it."""


def adviser(diagnosis: Diagnosis) -> Adviser:
    """What advises the findings of ``diagnosis`` (as it stands: `watch` asks again later)."""
    facts = run_facts(diagnosis)
    found: dict[tuple[int, str, int], Episode] = {}
    for episode in episodes(diagnosis):
        for finding in episode.findings:
            found.setdefault((episode.segment, finding.kind, finding.step), episode)

    def advise(segment: int, finding: Finding) -> Finding:
        episode = found.get((segment, finding.kind, finding.step))
        if episode is None:  # set-up advice: no episode
            return advised(finding, facts)
        return advised(finding, facts, episode.findings, recovered=episode.recovered)

    return advise
