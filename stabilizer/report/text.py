"""The human report, plain text: a header, a timeline of incidents, a one-line verdict.

    diagnosis of runs/megatron.log
    format    megatron
    records   480, steps 10–48000
    notes     line 13: Megatron losses are averages over the log interval ...

    timeline: 2 episodes
    #1  steps 12300–12800  WARNING  loss spike
        what      loss spiked from 2.41 to 7.9 (3.3x) at step 12400, back after 40 steps: ...
        evidence  baseline 2.41, peak 7.9, ratio 3.28
        cause     one batch with an outsized gradient pushed the weights off course; ...
        remedy    clip the global gradient norm to 1.0 (clip_gradients)
                  roll back to the last good checkpoint and step past the bad batch (rollback)

    set-up: the monitor's checks at the first batch
        INFO  no gradient clipping: ... -> clip the global gradient norm to 1.0 (clip_gradients)

    verdict: critical: 2 episodes (1 critical, 1 warning); act first on #2, ...

The set-up section (a ``stability.jsonl``'s preflight advice) follows the timeline: advice on
the configuration is no event of the run. Labels sit in a 10-character column; the episodes
of one incident (`stabilizer.report.incidents`; the report counts incidents as episodes)
give several ``what`` lines. Segments are listed only for a restarted run, notes
once per distinct message.
"""

from __future__ import annotations

from collections.abc import Sequence

from stabilizer.core.advice import RunFacts
from stabilizer.core.records import Finding, Severity
from stabilizer.core.run import RunHeader
from stabilizer.outputs.wording import counted
from stabilizer.replay.diagnose import Diagnosis, Failure, Segment, exit_code

from .causes import advice_for
from .check import check, log_disagreements
from .consistency import what
from .incidents import (
    Incident,
    evidence_text,
    header_facts,
    incidents,
    note_lines,
    outcome,
    remedy_lines,
    run_facts,
    setup_findings,
    step_range,
)
from .verdict import verdict

__all__ = ["render_overall", "render_text", "segment_text", "setup_line"]

_LABEL = 10  # width of the label column


def _block(label: str, lines: list[str], indent: str = "") -> list[str]:
    """``label`` beside the first line, the others aligned under it."""
    pad = indent + " " * _LABEL
    return [
        (f"{indent}{label:<{_LABEL}}" if i == 0 else pad) + line for i, line in enumerate(lines)
    ]


def segment_text(segment: Segment, first: RunHeader | None = None) -> str:
    """``"2  steps 200–400, 201 records; line 230: restart: step went back ..."``, and the
    segment's run facts where they are not the log's ``first``."""
    text = f"{segment.index}  {step_range(segment.first_step, segment.last_step)}, "
    text += counted(segment.records, "record")
    if segment.why:
        text += f"; line {segment.line}: {segment.why}" if segment.line else f"; {segment.why}"
    if segment.run is not None and segment.run != first:
        text += f"; run: {segment.run.describe()}"
    return text


def _header(diagnosis: Diagnosis) -> list[str]:
    name = "standard input" if diagnosis.path == "-" else diagnosis.path
    lines = [f"diagnosis of {name}"]
    for label, value in header_facts(diagnosis):
        lines += _block(label, [value])
    if len(diagnosis.segments) > 1:
        lines += _block("", [segment_text(s, diagnosis.run) for s in diagnosis.segments])
    notes = note_lines(diagnosis.notes)
    if notes:
        lines += _block("notes", notes)
    return lines


def _incident(incident: Incident, diagnosis: Diagnosis) -> list[str]:
    worst, segments = incident.worst, diagnosis.segments
    head = f"#{incident.number}  {step_range(incident.start, incident.end)}  "
    head += f"{worst.severity.name}  {advice_for(worst.kind).title}"
    if len(segments) > 1:
        head += f"  (segment {incident.segment})"
    segment, where = segments[incident.segment - 1], "segment" if len(segments) > 1 else "log"
    lines = [head, *_block("what", [what(f, segment, where) for f in incident.findings], "    ")]
    if incident.location:
        lines += _block("where", [", ".join(incident.location)], "    ")
    if incident.evidence:
        lines += _block("evidence", [evidence_text(incident.evidence)], "    ")
    ended = outcome(incident, segment, len(segments))
    if ended:
        lines += _block("outcome", [ended], "    ")
    lines += _block("cause", [incident.cause], "    ")
    if incident.remedies:
        remedies = remedy_lines(incident.remedies, worst.kind, incident.facts)
        lines += _block("remedy", remedies, "    ")
    return lines


def render_text(diagnosis: Diagnosis, fail_on: Severity = Severity.WARNING) -> str:
    """The text report of one diagnosis (no trailing newline)."""
    lines = _header(diagnosis)
    found = incidents(diagnosis)
    if found:
        lines += ["", f"timeline: {len(found)} episode{'s' if len(found) > 1 else ''}"]
        for incident in found:
            lines += _incident(incident, diagnosis)
    setup = setup_findings(diagnosis)
    if setup:
        lines += ["", "set-up: the monitor's checks at the first batch"]
        facts = run_facts(diagnosis, 1)  # (the first batch's checks: of the log's first run)
        lines += [f"    {setup_line(finding, facts)}" for finding in setup]
    lines += ["", f"verdict: {verdict(diagnosis, fail_on)}"]
    text = "\n".join(lines)
    log_disagreements(diagnosis.path, check(diagnosis, text))
    return text


def setup_line(finding: Finding, facts: RunFacts | None = None) -> str:
    """``"INFO  no gradient clipping: ... -> clip the global gradient norm to 1.0"``."""
    text = f"{finding.severity.name}  {finding.observation}"
    if finding.location:
        text += f" [{', '.join(finding.location)}]"
    if finding.remedies:
        text += f" -> {'; '.join(remedy_lines(finding.remedies, finding.kind, facts))}"
    return text


def render_overall(outcomes: Sequence[Diagnosis | Failure], fail_on: Severity) -> str:
    """The closing line of a report on several inputs: how many, the worst, the exit status."""
    worst = [o.worst() for o in outcomes if isinstance(o, Diagnosis)]
    found = max((severity for severity in worst if severity is not None), default=None)
    parts = [f"{len(outcomes)} inputs"]
    unreadable = len(outcomes) - len(worst)
    if unreadable:
        parts.append(f"{unreadable} unreadable")
    parts.append(f"worst finding: {'none' if found is None else found.name.lower()}")
    code = max((exit_code(outcome, fail_on) for outcome in outcomes), default=0)
    return f"overall: {', '.join(parts)}; exit status {code}"
