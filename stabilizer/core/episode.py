"""One episode, one entry: a detector's later finding of the same episode updates the first.

A detector reports an episode when it is sure of it and again when it ends (or escalates): an
fp16 overflow cascade is an ERROR at its third skipped step and an INFO when the scale holds
again; starved layers are a WARNING after 50 records and an INFO when the band is gone; a NaN
is an ERROR at its step and CRITICAL when it persists. Each later finding has the kind, the
start step and the location of the first: it is the same episode, *updated*. Every output keeps
one entry per episode: the console prints the update as an update (not as a finding of its
own), the reports and the JSON findings hold the latest state of the episode at the worst
severity it reached. ``stability.jsonl`` is append-only, so it holds the opening line and its
updates; its readers fold them the same way.

Findings the live monitor makes once (`ONE_SHOT_KINDS`: several ``config_risk`` at step 0 are
several risks) are never updates.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from .records import Finding

__all__ = ["ONE_SHOT_KINDS", "EpisodeKey", "episode_key", "fold_updates", "updated"]

ONE_SHOT_KINDS = frozenset(
    {"root_cause", "config_risk", "causal_leak", "remedy_applied", "remedy_result"}
)
"""Kinds the live monitor reports once per event, never as an update of another finding."""

EpisodeKey = tuple[str, int, tuple[str, ...]]


def episode_key(finding: Finding) -> EpisodeKey | None:
    """What a finding and its updates share (kind, start step, location); None for a one-shot
    kind, which has no updates."""
    if finding.kind in ONE_SHOT_KINDS:
        return None
    return finding.kind, finding.step, finding.location


def updated(first: Finding, later: Finding) -> Finding:
    """The episode of ``first`` after the update ``later``: the later message, span and
    evidence, at the worst severity the episode reached (an ERROR cascade that is over is still
    an ERROR episode)."""
    return replace(later, severity=max(first.severity, later.severity))


def fold_updates(findings: Iterable[Finding]) -> list[Finding]:
    """The findings in order, one per episode: each update folded into its episode's entry."""
    folded: list[Finding] = []
    at: dict[EpisodeKey, int] = {}
    for finding in findings:
        key = episode_key(finding)
        if key is not None and key in at:
            folded[at[key]] = updated(folded[at[key]], finding)
            continue
        if key is not None:
            at[key] = len(folded)
        folded.append(finding)
    return folded
