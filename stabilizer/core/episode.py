"""The episode rule of every output: when a later finding is the same episode, and how the
reports group episodes into one entry.

A detector reports an episode when it is sure of it and again when it ends or escalates (a NaN
is an ERROR at its step and CRITICAL when it persists). A later finding *continues* an earlier
one (`continues`) when it has its kind and start step (`episode_start`) and names the same
places, or one of the two names none: a NaN's first finding names every depth group whose
gradient went non-finite, its "persists" and "finite again" name none. It is the same episode,
*updated*: every output keeps one entry per episode (`merged`), with its latest message, span,
evidence and remedies, at the worst severity it reached, naming every place either named.
Findings only the live monitor makes (`stabilizer.core.kinds.LIVE_ONLY`: several
``config_risk`` at step 0 are several risks) are never updates.

The console, ``diagnose`` (and so every report, ``watch``), the notifier and TensorBoard's
findings table keep their episodes with `Episodes`. The reports then group the episodes that
one event raises together (`group_incidents`). Why and where: docs/findings.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from .kinds import LIVE_ONLY, family_rank
from .records import Finding, Severity

__all__ = [
    "Episode",
    "EpisodeStart",
    "Episodes",
    "continues",
    "episode_start",
    "fold_updates",
    "group_incidents",
    "merged",
]

EpisodeStart = tuple[str, int]


def episode_start(finding: Finding) -> EpisodeStart:
    """What every finding of an episode shares: its kind and start step."""
    return finding.kind, finding.step


def continues(new: Finding, old: Finding) -> bool:
    """Whether ``new`` is an update of the episode ``old`` stands for (see the module doc)."""
    if new.kind in LIVE_ONLY or episode_start(new) != episode_start(old):
        return False
    return new.location == old.location or not new.location or not old.location


def merged(old: Finding, new: Finding) -> Finding:
    """The episode of ``old`` after its update ``new``: the newer steps, message, evidence and
    remedies (a NaN that persists no longer suggests skipping one more step); the worst
    severity; every place either names."""
    ends = [step for step in (old.end_step, new.end_step) if step is not None]
    return replace(
        new,
        end_step=max(ends) if ends else None,
        severity=max(old.severity, new.severity),
        location=tuple(dict.fromkeys((*old.location, *new.location))),
    )


@dataclass
class Episode:
    """One episode as it stands.

    Args:
        finding: The episode now (`merged`): its latest message, span and evidence, at the worst
            severity it reached (an ERROR cascade that is over is still an ERROR episode).
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
        self._by_start: dict[EpisodeStart, list[Episode]] = {}

    def add(self, finding: Finding) -> Episode:
        """The episode of ``finding``: a new one, or the one it updates (``updates > 0``)."""
        same = self._by_start.setdefault(episode_start(finding), [])
        episode = next((e for e in same if continues(finding, e.finding)), None)
        if episode is None:
            episode = Episode(finding, len(self.all))
            self.all.append(episode)
            same.append(episode)
            return episode
        episode.was = episode.finding.severity
        episode.finding = merged(episode.finding, finding)
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


def group_incidents(located: Iterable[tuple[int, Finding]]) -> list[tuple[int, list[Finding]]]:
    """Episodes (one finding each, as `Episodes` leaves them), each with its segment, grouped
    into what a reader of a report takes for one event: an *incident*.

    One event raises several kinds: a loss spike comes with the gradient spike at its start, an
    fp16 overflow cascade with the NaN loss it causes and the root cause of that NaN. Episodes
    of one family (`stabilizer.core.kinds.Kind.family`) in one segment whose steps touch (one
    starting at most one step after the incident's last step) are one incident; an episode of
    no family joins the incident of its kind that starts at its step (two bands of starved
    layers found at one step). By segment, then step.
    """
    ordered = sorted(located, key=lambda item: (item[0], item[1].step))
    groups: list[tuple[int, list[Finding]]] = []
    latest: dict[tuple[int, str], list[Finding]] = {}  # the open incident by family (or kind)
    for segment, finding in ordered:
        rank = family_rank(finding.kind)
        family = finding.kind if rank is None else rank[0]
        found = latest.get((segment, family))
        if found is None or not _joins(finding, found, in_family=rank is not None):
            found = latest[segment, family] = []
            groups.append((segment, found))
        found.append(finding)
    return groups


def _joins(finding: Finding, found: list[Finding], in_family: bool) -> bool:
    """Whether ``finding`` belongs to the incident of ``found``: one of its family that starts
    at most one step after the incident's last step; else one of its kind at its first step."""
    if not in_family:
        return finding.step == found[0].step
    last = max(f.step if f.end_step is None else max(f.step, f.end_step) for f in found)
    return finding.step <= last + 1
