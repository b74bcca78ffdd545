"""Rescue benchmark: do the remedies of policy ``auto`` save failing runs?

    python benchmarks/rescue.py [--seeds 5] [--jobs 2] [--scenarios spike nan ...]

For each failure scenario and seed, trains (a) without the monitor, (b) with ``policy="protect"``,
(c) with ``policy="auto"``, and its healthy twin (the same scenario without the fault: no
corrupted batches, no activation overflow, pre-LN for ``post-ln-deep``) for the baseline. A run is
*rescued* when it finishes (all steps, finite weights, finite validation loss) within 10% of its
twin's validation loss. Prints a table per scenario; the results are recorded in
docs/benchmarks.md. Runs are independent processes (``--jobs`` at a time, one torch thread each).
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

from stabilizer.demo.scenarios import Scenario, get_scenario

VARIANTS = ("none", "protect", "auto")
TOLERANCE = 1.10  # rescued: validation loss within 10% of the healthy twin's


@dataclass(frozen=True)
class Result:
    scenario: str
    variant: str  # none | protect | auto | twin
    seed: int
    steps: int  # optimizer steps taken
    finite: bool  # every weight finite at the end
    val_loss: float
    skipped: int  # optimizer updates skipped (guard, scaler, after a rollback)
    remedies: str  # remedies applied, in order


def twin(sc: Scenario) -> Scenario:
    """The scenario without its fault."""
    model = replace(sc.model, norm_position="pre")
    return replace(sc, corrupt=None, lr_surge=None, activation_fault=None, model=model)


def train(job: tuple[str, str, int]) -> Result:
    name, variant, seed = job
    import torch

    torch.set_num_threads(1)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("stabilizer").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore")
    from stabilizer.callbacks import StabilityMonitor
    from stabilizer.callbacks.demo.run import run_scenario

    sc = replace(get_scenario(name), seed=seed)
    monitor = None
    if variant == "twin":
        sc = twin(sc)
    elif variant != "none":
        monitor = StabilityMonitor(policy=variant, jsonl=False)
    run = run_scenario(sc, accelerator="cpu", callbacks=[monitor] if monitor else [])
    val = run.trainer.callback_metrics.get("val/loss")
    finite = all(bool(torch.isfinite(p).all()) for p in run.module.parameters())
    findings = monitor.findings if monitor else []
    return Result(
        name,
        variant,
        seed,
        run.trainer.global_step,
        finite,
        float(val) if val is not None else math.nan,
        monitor.skipped_steps if monitor else 0,
        ",".join(f.remedies[0] for f in findings if f.kind == "remedy_applied"),
    )


def rescued(result: Result, baseline: float, steps: int) -> bool:
    ok = result.finite and math.isfinite(result.val_loss) and result.steps == steps
    return ok and result.val_loss <= TOLERANCE * baseline


def table(name: str, results: list[Result], seeds: int) -> str:
    steps = get_scenario(name).steps
    twins = {r.seed: r.val_loss for r in results if r.variant == "twin"}
    lines = [
        f"### `{name}` ({seeds} seeds; twin val loss {statistics.fmean(twins.values()):.3f} mean)",
        "",
        "| variant | rescued | finished | val loss (mean) | val / twin | updates skipped | "
        "remedies applied |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant in VARIANTS:
        rs = sorted((r for r in results if r.variant == variant), key=lambda r: r.seed)
        ok = sum(rescued(r, twins[r.seed], steps) for r in rs)
        done = sum(r.finite and r.steps == steps and math.isfinite(r.val_loss) for r in rs)
        vals = [r.val_loss for r in rs]
        mean = statistics.fmean(vals) if all(map(math.isfinite, vals)) else math.nan
        ratio = statistics.fmean(r.val_loss / twins[r.seed] for r in rs)
        skipped = statistics.fmean(r.skipped for r in rs)
        remedies = sorted({x for r in rs for x in r.remedies.split(",") if x})
        lines.append(
            f"| {variant} | {ok}/{len(rs)} | {done}/{len(rs)} | {mean:.3f} | {ratio:.3f} | "
            f"{skipped:.1f} | {', '.join(remedies) or '-'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument(
        "--scenarios",
        nargs="+",
        default=["spike", "surge", "nan", "nan-16-true", "post-ln-deep"],
    )
    args = parser.parse_args()
    jobs = [
        (name, variant, seed)
        for name in args.scenarios
        for seed in range(args.seeds)
        for variant in (*VARIANTS, "twin")
    ]
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(train, jobs))
    for name in args.scenarios:
        print(table(name, [r for r in results if r.scenario == name], args.seeds))
        print()
    for r in results:
        print(r)


if __name__ == "__main__":
    main()
