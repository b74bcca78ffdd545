"""How `stabilizer diagnose` does on real logs: every case of ``tests/fixtures/real``, scored.

    python benchmarks/real_logs.py [DIR]

DIR (default ``tests/fixtures/real``) holds ``logs/<id>.log`` and ``labels.jsonl`` (one object a
line: ``id``, ``label``, ``steps``; ``added`` marks the cases this project found, the others are
the twenty of the development set). Each log goes through ``stabilizer diagnose --json`` (the
command itself, run in this process) and is scored by the rule of the development set's
``score.py`` (its docstring; re-implemented here, nothing imported from it):

- ``healthy``: no finding at warning or above;
- ``nan``: a finding whose kind names nonfinite or nan, or an fp16 overflow;
- ``spike``: a loss or gradient spike;
- ``divergence``: a divergence, a loss spike (an excerpt may end before any recovery) or a stall;
- ``overflow``: an fp16 overflow (loss-scale cascade);
- ``grad_explosion``: a gradient spike or non-finite gradient, or a divergence;
- ``stall``: a stall (the loss sits at its chance level: the run does not learn);

and, when ``steps`` ``[lo, hi]`` are labelled, the finding's steps must overlap ``[lo, hi]``
widened by two logging intervals (the mean step distance between records). Findings at info
level do not count. Exit status 2, an exception or no JSON is a crash (a miss).

Prints one row per case (id, label, labelled steps, right or wrong, the findings) and the totals.

    python benchmarks/real_logs.py --added round5               # only the cases so marked
    python benchmarks/real_logs.py --added round5 --rule lightning

``--rule lightning`` scores Lightning's one-line rule instead of ``diagnose`` (its
``SpikeDetection`` defaults: a loss above 3x the mean of the last 10 losses, or a
non-finite loss, is an alarm) on the very records ``diagnose`` reads (``read_log``, the training
loss of each `StepRecord`), as findings ``loss_spike`` and ``nonfinite_loss`` scored by the same
rule: it sees no gradient norm, loss scale or trainer's words, by construction.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from stabilizer.cli import main as cli
from stabilizer.core.records import StepRecord
from stabilizer.core.signals import LOSS
from stabilizer.replay.readers import LogReadError, read_log

ROOT = Path(__file__).resolve().parents[1]

ACCEPT = {  # label → words one of which the kind of an answering finding holds
    "nan": ("nonfinite", "nan", "overflow"),
    "spike": ("spike",),
    "divergence": ("diverg", "loss_spike", "stall"),
    "overflow": ("overflow",),
    "grad_explosion": ("grad", "diverg"),
    "stall": ("stall",),
}


@dataclass
class Scored:
    """One case: its verdict (``ok``, ``MISS``, ``CRASH``) and what was found."""

    case: dict[str, Any]
    verdict: str
    found: str


def diagnose_json(path: Path) -> tuple[dict[str, Any] | None, str]:
    """The ``--json`` report of one log, or None and why there is none."""
    result = CliRunner().invoke(cli, ["diagnose", "--json", str(path)])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return None, f"{type(result.exception).__name__}: {result.exception}"
    if result.exit_code not in (0, 1):
        return None, f"exit {result.exit_code}: {result.stderr.strip()[-120:]}"
    try:
        data = json.loads(result.stdout)
    except ValueError:
        return None, "no JSON"
    return (data, "") if isinstance(data, dict) else (None, "no JSON object")


def lightning_json(path: Path) -> tuple[dict[str, Any] | None, str]:
    """Lightning's one-line rule on the records ``diagnose`` reads, as a ``--json``-like report."""
    try:
        records = [item for item in read_log(path) if isinstance(item, StepRecord)]
    except LogReadError as exc:
        return None, f"unread: {exc}"
    steps = [record.step for record in records]
    losses = [(r.step, r.values[LOSS]) for r in records if LOSS in r.values]
    span = {"first": steps[0], "last": steps[-1]} if steps else None
    return {
        "findings": lightning_alarms(losses),
        "inputs": [{"records": len(steps), "steps": span}],
    }, ""


def lightning_alarms(losses: list[tuple[int, float]]) -> list[dict[str, Any]]:
    """Alarms of ``SpikeDetection(window=10, warmup=1, rtol=2.0)``: > 3x the mean, or NaN."""
    window: deque[float] = deque(maxlen=10)
    alarms: list[dict[str, Any]] = []
    for step, loss in losses:
        if not math.isfinite(loss):
            alarms.append({"kind": "nonfinite_loss", "severity": "error", "step": step})
            continue
        if window and loss > 3 * sum(window) / len(window):
            alarms.append({"kind": "loss_spike", "severity": "warning", "step": step})
        window.append(loss)
    return alarms


def tolerance(data: dict[str, Any]) -> float:
    """Two logging intervals: twice the mean step distance between the records."""
    first = (data.get("inputs") or [{}])[0]
    steps, count = first.get("steps") or {}, first.get("records") or 0
    low, high = steps.get("first"), steps.get("last")
    if count > 1 and isinstance(low, (int, float)) and isinstance(high, (int, float)):
        return 2 * (high - low) / (count - 1)
    return 0.0


def answers(finding: dict[str, Any], label: str, window: list[int] | None, tol: float) -> bool:
    """Whether a finding answers a troubled case's label (and window)."""
    if not any(word in str(finding.get("kind", "")).lower() for word in ACCEPT[label]):
        return False
    if not window:
        return True
    start = finding.get("step")
    end = finding.get("end_step") if isinstance(finding.get("end_step"), (int, float)) else start
    if not isinstance(start, (int, float)) or not isinstance(end, (int, float)):
        return False
    return start <= window[1] + tol and end >= window[0] - tol


def score(case: dict[str, Any], logs: Path, rule: str = "diagnose") -> Scored:
    report = lightning_json if rule == "lightning" else diagnose_json
    data, why = report(logs / f"{case['id']}.log")
    if data is None:
        return Scored(case, "CRASH", why)
    findings = [
        f
        for f in data.get("findings", [])
        if isinstance(f, dict) and str(f.get("severity", "")).lower() not in ("info", "debug")
    ]
    shown = ", ".join(f"{f.get('kind')}@{f.get('step')}" for f in findings[:4])
    shown += f", +{len(findings) - 4}" if len(findings) > 4 else ""
    label = case["label"]
    if label == "healthy":
        right = not findings
    else:
        tol = tolerance(data)
        right = any(answers(f, label, case.get("steps"), tol) for f in findings)
    return Scored(case, "ok" if right else "MISS", shown or "-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dir", nargs="?", type=Path, default=ROOT / "tests" / "fixtures" / "real")
    parser.add_argument("--added", help="only the cases whose `added` is this (e.g. round5)")
    parser.add_argument(
        "--rule",
        choices=("diagnose", "lightning"),
        default="diagnose",
        help="diagnose (default), or Lightning's one-line rule on the same records",
    )
    args = parser.parse_args()
    lines = (args.dir / "labels.jsonl").read_text(encoding="utf-8").splitlines()
    cases = [json.loads(line) for line in lines if line.strip()]
    if args.added is not None:
        cases = [case for case in cases if str(case.get("added")) == args.added]
    rows = [score(case, args.dir / "logs", args.rule) for case in cases]
    print_rows(rows)
    print_totals("all", rows)
    dev = [row for row in rows if not row.case.get("added")]
    if dev:
        print_totals("dev", dev)


def print_rows(rows: list[Scored]) -> None:
    """One line per case: id, set, label, labelled steps, verdict, the findings."""
    width = max((len(row.case["id"]) for row in rows), default=4)
    print(f"{'case':<{width}}  {'set':<6} {'label':<14} {'steps':<14} {'right':<5}  findings")
    for row in rows:
        case = row.case
        steps = "-" if not case.get("steps") else f"{case['steps'][0]}-{case['steps'][1]}"
        added = case.get("added")
        where = added if isinstance(added, str) else ("added" if added else "dev")
        print(
            f"{case['id']:<{width}}  {where:<6} {case['label']:<14} {steps:<14} "
            f"{row.verdict:<5}  {row.found}"
        )


def print_totals(name: str, rows: list[Scored]) -> None:
    """Right of all, of the healthy and of the troubled; false alarms; unread (crashes)."""
    healthy = [r for r in rows if r.case["label"] == "healthy"]
    troubled = [r for r in rows if r.case["label"] != "healthy"]
    print(
        f"{name}: {sum(r.verdict == 'ok' for r in rows)}/{len(rows)} right (healthy "
        f"{sum(r.verdict == 'ok' for r in healthy)}/{len(healthy)}, troubled "
        f"{sum(r.verdict == 'ok' for r in troubled)}/{len(troubled)}), "
        f"{sum(r.verdict == 'MISS' for r in healthy)} false alarms, "
        f"{sum(r.verdict == 'CRASH' for r in rows)} crashes"
    )


if __name__ == "__main__":
    main()
