"""Harm benchmark (#31): does the monitor leave healthy runs as it found them?

    python benchmarks/harm.py [--regimes staged sgdr ...] [--seeds 3] [--steps N] [--jobs 2]
                              [--threads 1] [--policies none protect auto] [--findings]

Trains each healthy regime of `benchmarks.regimes` (a real Lightning ``Trainer`` on the CPU) per
seed without the monitor (``none``), with ``StabilityMonitor(policy="protect")`` and with
``StabilityMonitor(policy="auto")``, and computes each run's final eval (the regime's own: a
held-out loss, lower is better, > 0; ``benchmarks/regimes``). A monitored run *changed* the
run when it applied a remedy, skipped an update, stopped early or ended with non-finite
weights, or when its eval is worse than its twin's (the ``none`` run of the same seed) by more
than the seed spread: the range (max - min) of the ``none`` evals over the seeds run. A finding
at WARNING or above on a healthy run is a false alarm: counted apart (*warned*). Prints each
run, the findings behind each remedy (with ``--findings``: every remedy and every finding at
WARNING or above, as the console prints them), a table per regime, then one line per regime:
``harm REGIME: protect changed a/N, auto changed b/N, auto remedies [..], eval ratio to none
x–y; warned: protect c/N, auto d/N`` (the ratio is ``auto``'s eval over its twin's, lowest to
highest over the seeds). Runs are independent processes (``--jobs`` at a time, ``--threads``
torch threads each: 1 by default).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root holds `benchmarks`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl
import torch

from benchmarks.regimes import REGIMES, train_regime
from stabilizer.callbacks import StabilityMonitor
from stabilizer.core.records import Finding, Severity

POLICIES = ("none", "protect", "auto")


@dataclass(frozen=True)
class Result:
    regime: str
    policy: str  # none | protect | auto
    seed: int
    expected: int  # optimizer steps asked for
    steps: int  # optimizer steps taken
    finite: bool  # every weight finite at the end
    eval: float  # the regime's final eval (lower is better)
    skipped: int  # optimizer updates skipped (guard, rollback window)
    remedies: tuple[str, ...]  # "name@step", in order
    verdicts: tuple[str, ...]  # "name:worked@step" / "name:failed@step"
    warned: tuple[str, ...]  # findings at WARNING or above: "kind@step"
    lines: tuple[str, ...]  # those findings and every remedy_*, as the console says them
    losses: tuple[float, float]  # median training loss of the first and the last 10 steps
    seconds: float
    error: str = ""

    @property
    def acted(self) -> bool:
        """A remedy, a skipped update, an early stop, non-finite weights or a crash."""
        stopped = self.steps < self.expected or not self.finite or bool(self.error)
        return bool(self.remedies) or self.skipped > 0 or stopped


class Losses(pl.Callback):
    """The training loss of every batch: the per-run table shows that each run learns."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_train_batch_end(self, *args: object) -> None:
        out = args[2]  # (trainer, module, outputs, batch, batch_idx)
        if isinstance(out, dict) and "loss" in out:
            self.seen.append(float(out["loss"]))


def train(job: tuple[str, str, int, int | None, int]) -> Result:
    """One run (in a worker process): regime, policy, seed, steps (None: the regime's), threads."""
    name, policy, seed, steps, threads = job
    torch.set_num_threads(threads)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("stabilizer").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore")
    monitor = None if policy == "none" else StabilityMonitor(policy=policy, jsonl=False)
    losses = Losses()
    start = time.perf_counter()
    try:
        run = train_regime(name, seed, steps, callbacks=[losses, *([monitor] if monitor else [])])
        done, finite, value, error = run.trainer.global_step, run.finite, run.eval, ""
    except Exception as e:  # a crash is harm too: record it, keep the benchmark going
        done, finite, value = 0, False, math.nan
        error = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    expected = steps or REGIMES[name].steps
    return Result(
        name, policy, seed, expected, done, finite, value,
        monitor.skipped_steps if monitor else 0, *_said(monitor.findings if monitor else []),
        _ends(losses.seen), time.perf_counter() - start, error,
    )  # fmt: skip


Texts = tuple[str, ...]


def _said(findings: list[Finding]) -> tuple[Texts, Texts, Texts, Texts]:
    """Remedies applied, their verdicts, findings at WARNING or above, and the console lines."""
    acts = [f for f in findings if f.kind in ("remedy_applied", "remedy_result")]
    loud = [f for f in findings if f.severity >= Severity.WARNING and f.kind != "remedy_applied"]
    return (
        tuple(f"{f.remedies[0]}@{f.step}" for f in acts if f.kind == "remedy_applied"),
        tuple(
            f"{f.remedies[0]}:{'worked' if f.evidence.get('worked') else 'failed'}@{f.step}"
            for f in acts
            if f.kind == "remedy_result"
        ),
        tuple(f"{f.kind}@{f.step}" for f in loud if f.kind != "remedy_result"),
        tuple(str(f) for f in findings if f in acts or f in loud),
    )


def _ends(losses: list[float]) -> tuple[float, float]:
    if not losses:
        return math.nan, math.nan
    return statistics.median(losses[:10]), statistics.median(losses[-10:])


def spread(results: list[Result]) -> float:
    """The seed spread of a regime: max - min of its ``none`` evals (0 with one seed)."""
    values = [r.eval for r in results if r.policy == "none" and math.isfinite(r.eval)]
    return max(values) - min(values) if values else math.nan


def changed(r: Result, twin: Result, band: float) -> bool:
    """`Result.acted`, or an eval worse than the twin's by more than the seed spread."""
    worse = not math.isfinite(r.eval) or r.eval - twin.eval > band
    return r.acted or worse


def _steps(items: tuple[str, ...]) -> str:
    """``kind@step`` items, a kind seen more than 3 times as ``kind xN (steps a-b)``."""
    by_kind: dict[str, list[str]] = {}
    for item in items:
        kind, _, step = item.partition("@")
        by_kind.setdefault(kind, []).append(step)
    parts = [
        " ".join(f"{kind}@{s}" for s in steps)
        if len(steps) <= 3
        else f"{kind} x{len(steps)} (steps {steps[0]}-{steps[-1]})"
        for kind, steps in by_kind.items()
    ]
    return " ".join(parts) or "-"


def _names(items: list[str]) -> str:
    counts = Counter(item.split("@")[0] for item in items)
    return ", ".join(f"{k} x{v}" for k, v in counts.items()) or "-"


def run_table(results: list[Result]) -> str:
    twins = {(r.regime, r.seed): r for r in results if r.policy == "none"}
    lines = [
        "| regime | seed | policy | steps | train loss | eval | / none | skipped | "
        "remedies (step) | results | warnings | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        twin = twins.get((r.regime, r.seed))
        ratio = r.eval / twin.eval if twin and twin.eval else math.nan
        lines.append(
            f"| {r.regime} | {r.seed} | {r.policy} | {r.steps}/{r.expected} | "
            f"{r.losses[0]:.3g} → {r.losses[1]:.3g} | {r.eval:.4g} | "
            f"{ratio:.3f} | {r.skipped} | {' '.join(r.remedies) or '-'} | "
            f"{' '.join(r.verdicts) or '-'} | {_steps(r.warned)} | {r.seconds:.0f} |"
        )
    return "\n".join(lines)


def regime_table(name: str, results: list[Result], policies: list[str]) -> tuple[str, str]:
    twins = {r.seed: r for r in results if r.policy == "none"}
    band = spread(results)
    evals = [twins[s].eval for s in sorted(twins)]
    lines = [
        f"### `{name}` ({len(twins)} seeds; none eval {', '.join(f'{v:.4g}' for v in evals)}, "
        f"spread {band:.3g})",
        "",
        "| policy | changed | warned | eval / none per seed | skipped | remedies | results |",
        "|---|---|---|---|---|---|---|",
    ]
    counts: dict[str, tuple[int, int, list[float], list[str]]] = {}
    for policy in (p for p in policies if p != "none"):
        rs = sorted((r for r in results if r.policy == policy), key=lambda r: r.seed)
        ratios = [r.eval / twins[r.seed].eval for r in rs]
        n_changed = sum(changed(r, twins[r.seed], band) for r in rs)
        n_warned = sum(bool(r.warned) for r in rs)
        remedies = [x for r in rs for x in r.remedies]
        counts[policy] = (n_changed, n_warned, ratios, remedies)
        lines.append(
            f"| {policy} | {n_changed}/{len(rs)} | {n_warned}/{len(rs)} | "
            f"{', '.join(f'{x:.3f}' for x in ratios)} | "
            f"{statistics.fmean(r.skipped for r in rs):.1f} | {_names(remedies)} | "
            f"{_names([x for r in rs for x in r.verdicts])} |"
        )
    return "\n".join(lines), _summary(name, counts, len(twins))


def _summary(name: str, counts: dict[str, tuple[int, int, list[float], list[str]]], n: int) -> str:
    parts = [f"{p} changed {c[0]}/{n}" for p, c in counts.items()]
    text = f"harm {name}: {', '.join(parts)}"
    if "auto" in counts:
        _, _, ratios, remedies = counts["auto"]
        finite = [x for x in ratios if math.isfinite(x)] or [math.nan]
        text += f", auto remedies [{_names(remedies).replace('-', '')}]"
        text += f", eval ratio to none {min(finite):.3f}–{max(finite):.3f}"
    warned = [f"{p} {c[1]}/{n}" for p, c in counts.items()]
    return text + f"; warned: {', '.join(warned)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=list(REGIMES))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="override every regime's steps")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--findings", action="store_true", help="print each run's findings")
    parser.add_argument("--json", type=Path, help="also write every run's result to this file")
    args = parser.parse_args()
    policies = ["none", *(p for p in args.policies if p != "none")]  # none: every twin
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    jobs = [
        (name, policy, seed, args.steps, args.threads)
        for name in args.regimes
        for seed in seeds
        for policy in policies
    ]
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(train, jobs))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
    print(run_table(results), end="\n\n")
    for r in results:
        if (args.findings and r.lines) or r.error:
            print(f"{r.regime} seed {r.seed} {r.policy}:", *r.lines, r.error, sep="\n  ")
    summaries = []
    for name in args.regimes:
        text, summary = regime_table(name, [r for r in results if r.regime == name], policies)
        print(text, end="\n\n")
        summaries.append(summary)
    print("\n".join(summaries))  # last, one line per regime


if __name__ == "__main__":
    main()
