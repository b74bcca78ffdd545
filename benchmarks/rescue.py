"""Rescue benchmark: do the remedies of policy ``auto`` save failing runs?

    python benchmarks/rescue.py [--seeds 5] [--jobs 2] [--threads 1] [--scenarios diverge ...]
                                [--variants ...]

For each failure scenario and seed, trains (a) without the monitor, (b) with ``policy="protect"``,
(c) with ``policy="auto"``, (d) with ``auto`` less the scenario's own remedy (``REMEDY``), and its
healthy twin (``Scenario.twin()``: no corrupted batches, surge or activation fault, pre-LN, a
hand-written softmax in fp32) for the baseline. A run is *rescued* when it finishes (all steps,
finite weights, finite validation loss) within 10% of its twin's validation loss. Prints each run,
a table per scenario (with the ladder's ``remedy_result`` verdicts), then one line per scenario:
``rescue SCENARIO: none a/N, protect b/N, auto c/N, auto-without-REMEDY d/N``. Runs are
independent processes (``--jobs`` at a time, ``--threads`` torch threads each: 1 by default;
set ``OMP_NUM_THREADS`` to the same number).
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

from stabilizer.demo.scenarios import get_scenario

VARIANTS = ("none", "protect", "auto", "auto-without")
TOLERANCE = 1.10  # rescued: validation loss within 10% of the healthy twin's
REMEDY = {  # the article's remedy each scenario is for: disallowed in "auto-without"
    "spike": "clip_gradients",
    "spike-sgd": "clip_gradients",
    "surge": "rollback",
    "diverge": "rollback",
    "nan": "upcast_to_fp32",
    "nan-16-true": "upcast_to_fp32",
    "softmax-fp16": "upcast_to_fp32",
    "post-ln-deep": "swap_to_pre_ln",
}
DEFAULT = ("spike-sgd", "softmax-fp16", "post-ln-deep", "diverge")  # #23: the article's rows


@dataclass(frozen=True)
class Result:
    scenario: str
    variant: str  # none | protect | auto | auto-without | twin
    seed: int
    steps: int  # optimizer steps taken
    finite: bool  # every weight finite at the end
    val_loss: float
    skipped: int  # optimizer updates skipped (guard, scaler, after a rollback)
    remedies: str  # remedies applied, in order
    results: str  # remedy_result verdicts, in order: "name:worked" / "name:failed"


def train(job: tuple[str, str, int, int]) -> Result:
    name, variant, seed, threads = job
    import torch

    torch.set_num_threads(threads)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("stabilizer").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore")
    from stabilizer.callbacks import Auto, StabilityMonitor
    from stabilizer.callbacks.demo.run import run_scenario
    from stabilizer.core.remedies import AUTO_REMEDIES

    sc = replace(get_scenario(name), seed=seed)
    monitor = None
    if variant == "twin":
        sc = sc.twin()
    elif variant == "auto-without":
        allow = [r for r in AUTO_REMEDIES if r != REMEDY.get(name)]
        monitor = StabilityMonitor(policy=Auto(allow=allow), jsonl=False)
    elif variant != "none":
        monitor = StabilityMonitor(policy=variant, jsonl=False)
    run = run_scenario(sc, accelerator="cpu", callbacks=[monitor] if monitor else [])
    val = run.trainer.callback_metrics.get("val/loss")
    finite = all(bool(torch.isfinite(p).all()) for p in run.module.parameters())
    findings = monitor.findings if monitor else []
    verdicts = [
        f"{f.remedies[0]}:{'worked' if f.evidence.get('worked') else 'failed'}"
        for f in findings
        if f.kind == "remedy_result"
    ]
    return Result(
        name,
        variant,
        seed,
        run.trainer.global_step,
        finite,
        float(val) if val is not None else math.nan,
        monitor.skipped_steps if monitor else 0,
        ",".join(f.remedies[0] for f in findings if f.kind == "remedy_applied"),
        ",".join(verdicts),
    )


def rescued(result: Result, baseline: float, steps: int) -> bool:
    ok = result.finite and math.isfinite(result.val_loss) and result.steps == steps
    return ok and result.val_loss <= TOLERANCE * baseline


def label(name: str, variant: str) -> str:
    return f"auto-without-{REMEDY.get(name, '?')}" if variant == "auto-without" else variant


def _counts(items: list[str]) -> str:
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "-"


def row(name: str, variant: str, rs: list[Result], twins: dict[int, float]) -> tuple[str, int]:
    steps = get_scenario(name).steps
    ok = sum(rescued(r, twins[r.seed], steps) for r in rs)
    done = sum(r.finite and r.steps == steps and math.isfinite(r.val_loss) for r in rs)
    vals = [r.val_loss for r in rs]
    mean = statistics.fmean(vals) if all(map(math.isfinite, vals)) else math.nan
    ratio = statistics.fmean(r.val_loss / twins[r.seed] for r in rs)
    skipped = statistics.fmean(r.skipped for r in rs)
    remedies = sorted({x for r in rs for x in r.remedies.split(",") if x})
    verdicts = _counts([x for r in rs for x in r.results.split(",") if x])
    text = (
        f"| {label(name, variant)} | {ok}/{len(rs)} | {done}/{len(rs)} | {mean:.3f} | "
        f"{ratio:.3f} | {skipped:.1f} | {', '.join(remedies) or '-'} | {verdicts} |"
    )
    return text, ok


def table(name: str, results: list[Result], variants: list[str]) -> tuple[str, str]:
    twins = {r.seed: r.val_loss for r in results if r.variant == "twin"}
    seeds = len(twins)
    lines = [
        f"### `{name}` ({seeds} seeds; twin val loss {statistics.fmean(twins.values()):.3f} mean)",
        "",
        "| variant | rescued | finished | val loss (mean) | val / twin | updates skipped | "
        "remedies applied | remedy results |",
        "|---|---|---|---|---|---|---|---|",
    ]
    summary = []
    for variant in variants:
        rs = sorted((r for r in results if r.variant == variant), key=lambda r: r.seed)
        text, ok = row(name, variant, rs, twins)
        lines.append(text)
        summary.append(f"{label(name, variant)} {ok}/{len(rs)}")
    return "\n".join(lines), f"rescue {name}: {', '.join(summary)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--scenarios", nargs="+", default=list(DEFAULT))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = parser.parse_args()
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    jobs = [
        (name, variant, seed, args.threads)
        for name in args.scenarios
        for seed in seeds
        for variant in (*args.variants, "twin")
    ]
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(train, jobs))
    for r in results:
        print(r)
    print()
    summaries = []
    for name in args.scenarios:
        text, summary = table(name, [r for r in results if r.scenario == name], args.variants)
        print(text)
        print()
        summaries.append(summary)
    for summary in summaries:  # last, one line per scenario
        print(summary)


if __name__ == "__main__":
    main()
