"""One episode, one entry: `Episodes` folds a detector's later findings into the first.

A detector reports an episode when it is sure of it and again when it ends or escalates (a NaN
is an ERROR at its step and CRITICAL when it persists). A later finding with the kind, start
step and location of an earlier one is the same episode, *updated*: every output keeps one
entry per episode, at the worst severity it reached. Findings only the live monitor makes
(`stabilizer.core.kinds.LIVE_ONLY`: several ``config_risk`` at step 0 are several risks) are
never updates. Why and where: docs/findings.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from .kinds import LIVE_ONLY
from .records import Finding, Severity

__all__ = ["Episode", "EpisodeKey", "Episodes", "episode_key", "fold_updates"]

EpisodeKey = tuple[str, int, tuple[str, ...]]


def episode_key(finding: Finding) -> EpisodeKey | None:
    """What a finding and its updates share (kind, start step, location); None for a kind only
    the live monitor makes, which has no updates."""
    if finding.kind in LIVE_ONLY:
        return None
    return finding.kind, finding.step, finding.location


@dataclass
class Episode:
    """One episode as it stands.

    Args:
        finding: The episode now: its latest message, span and evidence, at the worst severity
            it reached (an ERROR cascade that is over is still an ERROR episode).
        index: Its place among the episodes, in the order they opened.
        updates: Findings folded into it after the first.
        was: Its severity before the latest update; None before any.
    """

    finding: Finding
    index: int
    updates: int = 0
    was: Severity | None = None


class Episodes:
    """The episodes of one stream (of one segment, in a replay): each finding opens one or
    updates the one it continues."""

    def __init__(self) -> None:
        self.all: list[Episode] = []
        self._open: dict[EpisodeKey, Episode] = {}

    def add(self, finding: Finding) -> Episode:
        """The episode of ``finding``: a new one, or the one it updates (``updates > 0``)."""
        key = episode_key(finding)
        episode = self._open.get(key) if key is not None else None
        if episode is None:
            episode = Episode(finding, len(self.all))
            self.all.append(episode)
            if key is not None:
                self._open[key] = episode
            return episode
        episode.was = episode.finding.severity
        episode.finding = replace(finding, severity=max(episode.was, finding.severity))
        episode.updates += 1
        return episode

    def findings(self) -> list[Finding]:
        """One finding per episode, in the order they opened."""
        return [episode.finding for episode in self.all]


def fold_updates(findings: Iterable[Finding]) -> list[Finding]:
    """The findings in order, one per episode: each update folded into its episode's entry."""
    episodes = Episodes()
    for finding in findings:
        episodes.add(finding)
    return episodes.findings()
