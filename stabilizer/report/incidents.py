"""What the text and markdown reports share: incidents, number formats, notes and the verdict.

An *incident* is what a reader of the report thinks of as one event, and the timeline's entry
(the reports count them as its episodes): the episodes one event raises together, grouped by
the one rule of `stabilizer.core.episode.group_incidents` (a loss spike with the gradient spike
at its start; an fp16 overflow cascade with the NaN loss it causes and the root cause of that
NaN), with every piece of evidence, titled by its main finding. The JSON report keeps every
finding as it is.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from stabilizer.core.advice import RunFacts, fitting_remedies, remedy_text
from stabilizer.core.episode import group_incidents
from stabilizer.core.kinds import family_rank, kind_of
from stabilizer.core.records import Finding
from stabilizer.core.signals import LOSS_SCALE, SKIPPED
from stabilizer.outputs.findings_table import is_setup
from stabilizer.replay.diagnose import Diagnosis, Segment
from stabilizer.replay.readers import Note

from .causes import cause_for
from .consistency import refuted

__all__ = [
    "Incident",
    "evidence_text",
    "header_facts",
    "incidents",
    "is_setup",
    "note_lines",
    "number",
    "outcome",
    "remedy_lines",
    "run_facts",
    "setup_findings",
    "step_range",
]

MAX_NOTES = 12  # distinct notes listed; the JSON report has them all


@dataclass(frozen=True)
class Incident:
    """The episodes one event raised in one segment (`group_incidents`), in the order they came.

    Args:
        number: 1-based position in the report's timeline.
        segment: The segment (1-based).
        findings: The findings, one per episode.
        facts: What the log tells of the run.
        recovered: Whether the run recovered from it, as the outcome line says (`outcome`);
            None when the outcome says neither.
    """

    number: int
    segment: int
    findings: tuple[Finding, ...]
    facts: RunFacts = field(default_factory=RunFacts)
    recovered: bool | None = None

    @property
    def worst(self) -> Finding:
        """The finding that sets severity and advice: the most severe; of equals, the main kind
        of the family, then the last."""
        return max(reversed(self.findings), key=lambda f: (f.severity, _precedence(f.kind)))

    @property
    def cause(self) -> str:
        """The likely cause, as the incident's evidence, its outcome and the run tell."""
        return cause_for(self.worst.kind, self.findings, self.facts, self.recovered)

    @property
    def start(self) -> int:
        """The first step."""
        return min(f.step for f in self.findings)

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
        """Every remedy suggested that fits the run (`stabilizer.core.advice`), once, the worst
        finding's first."""
        ordered = (self.worst, *self.findings)
        names = tuple(name for f in ordered for name in f.remedies)
        return fitting_remedies(names, self.findings, self.facts, recovered=self.recovered)

    @property
    def evidence(self) -> dict[str, float]:
        """The evidence of all the findings: the worst finding's as it is, another kind's under
        ``<kind>.<key>`` where the names clash (the gradient spike's ``peak`` beside the loss
        spike's)."""
        worst = self.worst
        merged: dict[str, float] = dict(worst.evidence)
        for finding in self.findings:
            for key, value in finding.evidence.items():
                if finding.kind != worst.kind and key in worst.evidence:
                    key = f"{finding.kind}.{key}"
                merged.setdefault(key, value)
        return merged


def setup_findings(diagnosis: Diagnosis) -> list[Finding]:
    """The set-up advice of the run (from the monitor's checks at its first batch), worst first."""
    found = [item.finding for item in diagnosis.findings if is_setup(item.finding)]
    return sorted(found, key=lambda f: -f.severity)


def incidents(diagnosis: Diagnosis) -> list[Incident]:
    """The diagnosis's findings as incidents, by segment, then step (`group_incidents`); set-up
    advice (`is_setup`) is no incident."""
    events = [item for item in diagnosis.findings if not is_setup(item.finding)]
    segments = diagnosis.segments
    made = [
        Incident(number, segment, tuple(found), run_facts(diagnosis, segment))
        for number, (segment, found) in enumerate(group_incidents(events), 1)
    ]
    return [replace(e, recovered=_recovered(e, segments)) for e in made]


def _recovered(incident: Incident, segments: Sequence[Segment]) -> bool | None:
    """What the incident's outcome line says: recovered (True), never (False), or neither."""
    said = outcome(incident, segments[incident.segment - 1], len(segments))
    return True if said.startswith("recovered") else False if said else None


def _precedence(kind: str) -> int:
    """A kind's precedence in its family (the main kind highest); 0 for a kind of none."""
    rank = family_rank(kind)
    return 0 if rank is None else rank[1]


def run_facts(diagnosis: Diagnosis, segment: int | None = None) -> RunFacts:
    """What the log tells (of ``segment``'s run, when given: a log may hold several runs): fp16
    (a loss scale logged), the spans with skipped steps, and the precision its header names."""
    bins = diagnosis.history.bins
    skipped = tuple(
        (one.first_step, one.last_step)
        for one in bins
        if SKIPPED in one.series and one.series[SKIPPED][1] >= 0.5
        and segment in (None, one.segment)
    )  # fmt: skip
    seen = diagnosis.history.keys()
    run = diagnosis.run
    if segment is not None and 0 < segment <= len(diagnosis.segments):
        run = diagnosis.segments[segment - 1].run or run
    low, precision = (None, "") if run is None else (run.low_precision, run.precision)
    fp16 = LOSS_SCALE in seen
    no_scaler = not fp16 and any(note.kind == "no_fp16_scaler" for note in diagnosis.notes)
    return RunFacts(fp16, skipped, low, precision, no_scaler)


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


def remedy_lines(
    remedies: Sequence[str], kind: str = "", facts: RunFacts | None = None
) -> list[str]:
    """Each remedy's action (after a finding of ``kind``, in a run of ``facts``), in order, with
    its name: ``"clip ... to 1.0 (clip_gradients)"``."""
    return [f"{remedy_text(name, kind, facts)} ({name})" for name in remedies]


def outcome(incident: Incident, segment: Segment, segments: int) -> str:
    """Whether a non-finite incident ended, as the log tells; for another incident, that it
    never did where the log refutes the recovery its findings claim (`refuted`); else ``""``."""
    where = "segment" if segments > 1 else "log"
    if not kind_of(incident.worst.kind).outcome:
        since = refuted(incident.findings, segment)
        if since is None:
            return ""
        return (
            f"never recovers: the loss is non-finite from step {since} to the end of the {where} "
            f"(step {segment.last_step})"
        )
    since, last = segment.nonfinite_since, incident.end or incident.start
    if since is not None and since <= last:
        return (
            f"never recovers: the loss is non-finite from step {since} to the end of the {where} "
            f"(step {segment.last_step})"
        )
    if segment.last_step <= last:
        return ""
    return (
        f"recovered: the run went on past step {last}, and its last loss (step "
        f"{segment.last_step}, the end of the {where}) is finite"
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
    """The header as (label, value) pairs: format, the run's facts (when its log has them),
    records and steps, segments."""
    steps = diagnosis.steps
    span = "" if steps is None else f", {step_range(*steps)}"
    segments = diagnosis.segments
    facts = [("format", diagnosis.format)]
    if diagnosis.run is not None:
        facts.append(("run", diagnosis.run.describe()))
    facts.append(("records", f"{diagnosis.records}{span}"))
    if len(segments) > 1:
        facts.append(("segments", f"{len(segments)} ({_segments(segments)})"))
    return facts


def _segments(segments: Sequence[Segment]) -> str:
    """``"2 runs in one log"``, ``"the run was restarted"``, or both: what the segments are."""
    runs = 1 + sum(segment.new_run for segment in segments)
    restarts = len(segments) - runs
    if runs == 1:
        return "the run was restarted"
    said = f"{runs} runs in one log"
    return said if not restarts else f"{said}, {restarts} restart{'s' if restarts > 1 else ''}"
