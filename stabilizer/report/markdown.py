"""The human report as markdown: the content of the text report, for a pull request or a wiki.

    ## Diagnosis of `runs/megatron.log`

    | | |
    |---|---|
    | format | megatron |
    | records | 480, steps 10–48000 |

    **Notes**
    - line 13: Megatron losses are averages over the log interval ...

    ### Timeline

    #### #1 · steps 12300–12800 · WARNING · loss spike
    - **what:** loss spiked from 2.41 to 7.9 ...
    - **likely cause:** one batch with an outsized gradient ...
    - **remedy:** clip the global gradient norm to 1.0 (`clip_gradients`); ...

    **Verdict:** critical: 2 episodes ...

The structure is that of `stabilizer.report.text`, with the same incidents and verdict.
"""

from __future__ import annotations

from stabilizer.core.advice import remedy_text
from stabilizer.core.records import Severity
from stabilizer.replay.diagnose import Diagnosis

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
    run_facts,
    setup_findings,
    step_range,
)
from .text import segment_text, setup_line
from .verdict import verdict

__all__ = ["render_markdown"]


def _escape(text: str) -> str:
    """Text safe inside a table cell or a list item."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("*", "\\*").replace("_", "\\_")


def _header(diagnosis: Diagnosis) -> list[str]:
    name = "standard input" if diagnosis.path == "-" else f"`{diagnosis.path}`"
    lines = [f"## Diagnosis of {name}", "", "| | |", "|---|---|"]
    lines += [f"| {label} | {_escape(value)} |" for label, value in header_facts(diagnosis)]
    if len(diagnosis.segments) > 1:
        lines += ["", "**Segments**", ""]
        shown = [segment_text(s, diagnosis.run) for s in diagnosis.segments]
        lines += [f"{_escape(text).replace('  ', '. ', 1)}" for text in shown]
    notes = note_lines(diagnosis.notes)
    if notes:
        lines += ["", "**Notes**", "", *(f"- {_escape(note)}" for note in notes)]
    return lines


def _incident(incident: Incident, diagnosis: Diagnosis) -> list[str]:
    worst, segments = incident.worst, diagnosis.segments
    title = f"#{incident.number} · {step_range(incident.start, incident.end)} · "
    title += f"{worst.severity.name} · {advice_for(worst.kind).title}"
    if len(segments) > 1:
        title += f" · segment {incident.segment}"
    lines = ["", f"#### {title}", ""]
    segment, where = segments[incident.segment - 1], "segment" if len(segments) > 1 else "log"
    lines += [f"- **what:** {_escape(what(f, segment, where))}" for f in incident.findings]
    if incident.location:
        lines.append("- **where:** " + ", ".join(f"`{name}`" for name in incident.location))
    if incident.evidence:
        lines.append(f"- **evidence:** {_escape(evidence_text(incident.evidence))}")
    ended = outcome(incident, segment, len(segments))
    if ended:
        lines.append(f"- **outcome:** {ended}")
    lines.append(f"- **likely cause:** {incident.cause}")
    if incident.remedies:
        kind = incident.worst.kind
        actions = [
            f"{remedy_text(name, kind, incident.facts)} (`{name}`)" for name in incident.remedies
        ]
        lines.append("- **remedy:** " + "; ".join(actions))
    return lines


def render_markdown(diagnosis: Diagnosis, fail_on: Severity = Severity.WARNING) -> str:
    """The markdown report of one diagnosis (no trailing newline)."""
    lines = _header(diagnosis)
    found = incidents(diagnosis)
    if found:
        lines += ["", "### Timeline"]
        for incident in found:
            lines += _incident(incident, diagnosis)
    setup = setup_findings(diagnosis)
    if setup:
        lines += ["", "### Set-up", ""]
        facts = run_facts(diagnosis, 1)  # (the first batch's checks: of the log's first run)
        lines += [f"- {_escape(setup_line(finding, facts))}" for finding in setup]
    lines += ["", f"**Verdict:** {_escape(verdict(diagnosis, fail_on))}"]
    text = "\n".join(lines)
    log_disagreements(diagnosis.path, check(diagnosis, text))
    return text
