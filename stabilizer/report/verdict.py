"""The verdict: one line on how bad the run is and what to do first.

    critical: 2 episodes (1 critical, 1 warning); act first on #2, non-finite loss (NaN/Inf) at
    steps 2010–2070: roll back ...; segment 2, after the last restart, is clean

Set-up advice is counted apart (``1 set-up note (1 info)``); a run with no episode is
healthy unless its set-up holds a risk at warning or above.
"""

from __future__ import annotations

from collections.abc import Iterable

from stabilizer.core.advice import remedy_text
from stabilizer.core.records import Finding, Severity
from stabilizer.outputs.wording import counted
from stabilizer.replay.diagnose import Diagnosis, severity_counts

from .causes import advice_for
from .incidents import incidents, setup_findings, step_range

__all__ = ["verdict"]


def verdict(diagnosis: Diagnosis, fail_on: Severity) -> str:
    """One line: how bad the run is and what to do first."""
    found = incidents(diagnosis)
    cut = any(note.kind == "truncated" for note in diagnosis.notes)
    tail = "; the log is cut short: read up to the damage" if cut else ""
    setup = setup_findings(diagnosis)
    if setup:
        count = f"{len(setup)} set-up note{'s' if len(setup) > 1 else ''}"
        tail = f"; {count} ({', '.join(_tally(setup))}){tail}"
    if not found:
        head = "healthy"
        if setup and setup[0].severity >= Severity.WARNING:  # a risk the run did not show yet
            head = setup[0].severity.name.lower() + _below(setup[0].severity, fail_on)
        return f"{head}: no instabilities found in {counted(diagnosis.records, 'record')}{tail}"
    tally = ", ".join(_tally(e.worst for e in found))
    first = min(found, key=lambda e: (-e.worst.severity, e.segment, e.start))
    head = first.worst.severity.name.lower()
    act = f"act first on #{first.number}, {advice_for(first.worst.kind).title} at "
    act += step_range(first.start, first.end)
    if first.worst.evidence.get("never_learned"):  # a blow-up from the start: say which failure
        act += " (the run never learned)"
    if first.remedies:
        act += f": {remedy_text(first.remedies[0], first.worst.kind, first.facts)}"
    below = _below(first.worst.severity, fail_on)
    plural = "s" if len(found) > 1 else ""
    last = diagnosis.segments[-1]
    clean = ""
    if last.index > 1 and all(incident.segment < last.index for incident in found):
        after = "a new run" if last.new_run else "after the last restart"
        clean = f"; segment {last.index}, {after}, is clean"
    return f"{head}{below}: {len(found)} episode{plural} ({tally}); {act}{clean}{tail}"


def _tally(findings: Iterable[Finding]) -> list[str]:
    """``["1 critical", "2 warning"]``: the findings per severity, worst first."""
    return [f"{count} {name}" for name, count in severity_counts(findings).items() if count]


def _below(severity: Severity, fail_on: Severity) -> str:
    return "" if severity >= fail_on else f" (below --fail-on {fail_on.name.lower()})"
