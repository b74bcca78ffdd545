"""The machine report: one strict-JSON object for every input of a ``stabilizer diagnose`` run.

    {
      "inputs": [{"path": ..., "format": ..., "run": {"type": "run", "precision": ..., ...},
                  "records": ..., "steps": {"first": .., "last": ..},
                  "segments": [...], "notes": [...], "summary": {...}},
                 {"path": ..., "error": "one line", "summary": {"exit_code": 2}}],
      "findings": [{<Finding.to_dict()>, "input": 0, "segment": 1}, ...],
      "summary": {"inputs": .., "unreadable": .., "findings": .., "counts": {"critical": ..},
                  "worst": "error", "fail_on": "warning", "exit_code": 1}
    }

``run`` is the run's facts from a ``stability.jsonl``'s header (`RunHeader`), else null.
``input`` is the position in ``inputs``; ``segment`` is 1-based. An episode is one finding: a
detector's update of it (the cascade is over) replaced its first finding. A finding's
``remedies`` and ``advice`` are those that fit the run (`stabilizer.report.advising`), as the
text report and every other output say them. Non-finite numbers are the
strings ``"nan"``, ``"inf"`` and ``"-inf"``, as in the run's JSONL log.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from stabilizer.core.records import Finding, Severity
from stabilizer.replay.diagnose import Diagnosis, Failure, exit_code, severity_counts

from .advising import adviser

__all__ = ["MAX_NOTES", "report_dict"]

MAX_NOTES = 1000  # notes listed per input; the rest are counted


def _summary(findings: list[Finding], code: int) -> dict[str, Any]:
    worst = max((f.severity for f in findings), default=None)
    return {
        "findings": len(findings),
        "counts": severity_counts(findings),
        "worst": None if worst is None else worst.name.lower(),
        "exit_code": code,
    }


def _input(outcome: Diagnosis | Failure, fail_on: Severity) -> dict[str, Any]:
    code = exit_code(outcome, fail_on)
    if isinstance(outcome, Failure):
        return {"path": outcome.path, "error": outcome.message, "summary": {"exit_code": code}}
    steps = outcome.steps
    notes = [asdict(note) for note in outcome.notes[:MAX_NOTES]]
    findings = [item.finding for item in outcome.findings]
    return {
        "path": outcome.path,
        "format": outcome.format,
        "run": None if outcome.run is None else outcome.run.to_dict(),
        "records": outcome.records,
        "steps": {"first": steps[0], "last": steps[1]} if steps else None,
        "segments": [asdict(segment) for segment in outcome.segments],
        "notes": notes,
        "notes_omitted": max(0, len(outcome.notes) - MAX_NOTES),
        "summary": _summary(findings, code),
    }


def report_dict(outcomes: Sequence[Diagnosis | Failure], fail_on: Severity) -> dict[str, Any]:
    """The report of every input, in order (see the module docstring)."""
    findings: list[dict[str, Any]] = []
    everything: list[Finding] = []
    for index, outcome in enumerate(outcomes):
        if isinstance(outcome, Diagnosis):
            advise = adviser(outcome)
            for segment, finding in outcome.findings:
                shown = advise(segment, finding).to_dict()
                findings.append({**shown, "input": index, "segment": segment})
                everything.append(finding)
    code = max((exit_code(outcome, fail_on) for outcome in outcomes), default=0)
    summary = _summary(everything, code)
    summary["inputs"] = len(outcomes)
    summary["unreadable"] = sum(isinstance(outcome, Failure) for outcome in outcomes)
    summary["fail_on"] = fail_on.name.lower()
    return {
        "inputs": [_input(outcome, fail_on) for outcome in outcomes],
        "findings": findings,
        "summary": summary,
    }
