"""What the text and markdown reports share: episodes, number formats, notes and the verdict.

An *episode* is what a reader of the report thinks of as one event. Detectors report most
episodes as one finding; a NaN that persists is two (the first step at once, then "not
recovering"), so findings of one kind that start at the same step of the same segment are shown
as one episode, at the worst severity. The JSON report keeps every finding as it is.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from stabilizer.core.records import Finding, Severity
from stabilizer.replay.diagnose import Diagnosis, Segment, severity_counts
from stabilizer.replay.readers import Note

from .advice import advice_for, remedy_text

__all__ = [
    "Episode",
    "episodes",
    "evidence_text",
    "header_facts",
    "note_lines",
    "number",
    "outcome",
    "remedy_lines",
    "step_range",
    "verdict",
]

MAX_NOTES = 12  # distinct notes listed; the JSON report has them all


@dataclass(frozen=True)
class Episode:
    """Findings of one kind that start at one step of one segment, in the order they came.

    Args:
        number: 1-based position in the report's timeline.
        segment: The segment (1-based).
        findings: The findings, as emitted.
    """

    number: int
    segment: int
    findings: tuple[Finding, ...]

    @property
    def worst(self) -> Finding:
        """The finding that sets severity and advice: the most severe, the last of equals."""
        return max(reversed(self.findings), key=lambda finding: finding.severity)

    @property
    def start(self) -> int:
        """The first step."""
        return self.worst.step

    @property
    def end(self) -> int | None:
        """The last step any of the findings covers."""
        ends = [f.end_step for f in self.findings if f.end_step is not None]
        return max(ends) if ends else None

    @property
    def location(self) -> tuple[str, ...]:
        """Every location named, in order of first mention."""
        return tuple(dict.fromkeys(name for f in self.findings for name in f.location))

    @property
    def remedies(self) -> tuple[str, ...]:
        """Every remedy suggested, the worst finding's first."""
        ordered = (self.worst, *self.findings)
        return tuple(dict.fromkeys(name for f in ordered for name in f.remedies))

    @property
    def evidence(self) -> dict[str, float]:
        """The evidence of all the findings, the worst finding's values winning."""
        merged: dict[str, float] = {}
        for finding in (*self.findings, self.worst):
            merged.update(finding.evidence)
        return merged


def episodes(diagnosis: Diagnosis) -> list[Episode]:
    """The diagnosis's findings as episodes, by segment, then step (see the module docstring)."""
    groups: dict[tuple[int, str, int], list[Finding]] = {}
    for segment, finding in diagnosis.findings:
        groups.setdefault((segment, finding.kind, finding.step), []).append(finding)
    ordered = sorted(groups.items(), key=lambda item: (item[0][0], item[0][2], item[0][1]))
    return [
        Episode(number, segment, tuple(found))
        for number, ((segment, _, _), found) in enumerate(ordered, 1)
    ]


def number(value: float) -> str:
    """A compact number: integers as such, others to 4 significant digits, NaN and Inf spelt."""
    if not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.4g}"


def step_range(start: int, end: int | None) -> str:
    """``"step 12"`` or ``"steps 12–40"``."""
    return f"step {start}" if end is None or end == start else f"steps {start}–{end}"


def evidence_text(evidence: Mapping[str, float]) -> str:
    """``"baseline 2.41, peak 7.9, ratio 3.3"``."""
    return ", ".join(f"{key} {number(value)}" for key, value in evidence.items())


def remedy_lines(remedies: Sequence[str]) -> list[str]:
    """Each remedy's action, in order, with its name: ``"clip ... to 1.0 (clip_gradients)"``."""
    return [f"{remedy_text(name)} ({name})" for name in remedies]


def outcome(episode: Episode, segment: Segment, segments: int) -> str:
    """Whether a non-finite episode ever ended, when the log tells; else ``""``."""
    if episode.worst.kind not in ("nonfinite_loss", "nonfinite_grad"):
        return ""
    since = segment.nonfinite_since
    if since is None or since > (episode.end or episode.start):
        return ""
    where = "segment" if segments > 1 else "log"
    return (
        f"never recovers: the loss is non-finite from step {since} to the end of the {where} "
        f"(step {segment.last_step})"
    )


def note_lines(notes: Iterable[Note]) -> list[str]:
    """The notes to show (restarts are shown as segments), repeats counted, at most MAX_NOTES."""
    first: dict[tuple[str, str], Note] = {}
    count: Counter[tuple[str, str]] = Counter()
    for note in notes:
        if note.kind != "restart":
            first.setdefault((note.kind, note.message), note)
            count[note.kind, note.message] += 1
    lines = [
        str(note) + (f" (and {count[key] - 1} more like it)" if count[key] > 1 else "")
        for key, note in first.items()
    ]
    if len(lines) > MAX_NOTES:
        lines = [*lines[:MAX_NOTES], f"… and {len(lines) - MAX_NOTES} more notes (see --json)"]
    return lines


def header_facts(diagnosis: Diagnosis) -> list[tuple[str, str]]:
    """The header as (label, value) pairs: format, records and steps, segments."""
    steps = diagnosis.steps
    span = "" if steps is None else f", {step_range(*steps)}"
    segments = diagnosis.segments
    facts = [("format", diagnosis.format), ("records", f"{diagnosis.records}{span}")]
    if len(segments) > 1:
        facts.append(("segments", f"{len(segments)} (the run was restarted)"))
    return facts


def verdict(diagnosis: Diagnosis, fail_on: Severity) -> str:
    """One line: how bad the run is and what to do first."""
    found = episodes(diagnosis)
    cut = any(note.kind == "truncated" for note in diagnosis.notes)
    tail = "; the log is cut short: read up to the damage" if cut else ""
    if not found:
        return f"healthy: no instabilities found in {diagnosis.records} records{tail}"
    counts = severity_counts(e.worst for e in found)
    tally = ", ".join(f"{count} {name}" for name, count in counts.items() if count)
    first = min(found, key=lambda e: (-e.worst.severity, e.segment, e.start))
    head = first.worst.severity.name.lower()
    act = f"act first on #{first.number}, {advice_for(first.worst.kind).title} at "
    act += step_range(first.start, first.end)
    if first.remedies:
        act += f": {remedy_text(first.remedies[0])}"
    below = "" if first.worst.severity >= fail_on else f" (below --fail-on {fail_on.name.lower()})"
    plural = "s" if len(found) > 1 else ""
    last = diagnosis.segments[-1].index
    clean = ""
    if last > 1 and all(episode.segment < last for episode in found):
        clean = f"; segment {last}, after the last restart, is clean"
    return f"{head}{below}: {len(found)} episode{plural} ({tally}); {act}{clean}{tail}"
