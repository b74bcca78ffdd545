"""Train every scenario over seeds and torch thread counts, and print each claim's margins.

    python tests/scenario_sweep.py [--seeds 0 1 2 3 4] [--threads 1 2] [--scenarios NAME ...]
                                   [--jobs 2] [--out DIR]

Each (seed, threads) pair trains all scenarios in a fresh process with ``OMP_NUM_THREADS`` and
``torch.set_num_threads`` set to ``threads`` (the thread count changes the order of float sums,
so the runs differ from the first steps on) and writes one JSON file of curves per scenario. The
table lists, per scenario and margin, the value for every run and the bound of its claim; the
results are recorded in docs/scenarios.md. ``test_scenarios.py --sweep`` asserts the same.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from scenario_claims import TWINS, Curves, Margin, Trace, claims

from stabilizer.demo.scenarios import SCENARIOS, get_scenario

__all__ = ["Run", "load", "margins", "sweep"]

SEEDS = (0, 1, 2, 3, 4)
THREADS = (1, 2)


@dataclass
class Run:
    """A scenario's curves as read back from its JSON file (see ``scenario_claims.Curves``)."""

    loss: list[float]
    block_norms: list[list[float]]
    grad_norm: list[float]
    loss_scale: list[float]
    lr: list[float]
    finite_weights: bool


def _path(out: Path, name: str, seed: int, threads: int) -> Path:
    return out / f"{name}_s{seed}_t{threads}.json"


def _train(seed: int, threads: int, out: Path, names: Sequence[str]) -> None:
    """The worker: scenarios ``names`` for ``seed``, one JSON file each (NaN is written as NaN)."""
    import logging

    import torch

    from stabilizer.callbacks.demo.run import run_scenario

    torch.set_num_threads(threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    for name in names:
        trace = Trace()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sc = replace(get_scenario(name), seed=seed)
            run_scenario(sc, accelerator="cpu", callbacks=[trace], validate=False)
        curves = {k: getattr(trace, k) for k in Run.__dataclass_fields__}
        _path(out, name, seed, threads).write_text(json.dumps(curves))


def _with_twins(names: Sequence[str]) -> list[str]:
    """``names`` and the twins their claims compare with, in ``SCENARIOS`` order."""
    wanted = set(names) | {TWINS[n] for n in names if n in TWINS}
    return [n for n in SCENARIOS if n in wanted]


def sweep(
    seeds: Sequence[int],
    threads: Sequence[int],
    out: Path,
    jobs: int = 2,
    names: Sequence[str] = tuple(SCENARIOS),
) -> None:
    """Train scenarios ``names`` (and their twins) for every (seed, threads) pair, each pair in
    its own process, ``jobs`` at a time, into ``out``."""
    names = _with_twins(names)

    def one(pair: tuple[int, int]) -> None:
        seed, n = pair
        if all(_path(out, name, seed, n).exists() for name in names):
            return  # trained by an earlier sweep into the same directory
        # PASSIVE: idle OpenMP threads sleep instead of spinning; on a loaded CPU spinning slows a
        # 2-thread run ~10x. It changes who waits how, not what is summed in which order.
        env = {**os.environ, "OMP_NUM_THREADS": str(n), "OMP_WAIT_POLICY": "PASSIVE"}
        worker = [sys.executable, __file__, "--worker", str(seed), str(n), str(out), *names]
        done = subprocess.run(worker, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"seed {seed}, {n} threads failed:\n{done.stderr[-3000:]}")

    out.mkdir(parents=True, exist_ok=True)
    pairs = [(s, n) for s in seeds for n in threads]
    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(one, pairs))


def load(out: Path, name: str, seed: int, threads: int) -> Run:
    """One scenario's curves from a sweep's directory."""
    return Run(**json.loads(_path(out, name, seed, threads).read_text()))


def margins(out: Path, name: str, seed: int, threads: int) -> list[Margin]:
    """The margins of scenario ``name``'s claim for one run of a sweep."""
    twins: dict[str, Curves] = {}
    if name in TWINS:
        twins[TWINS[name]] = load(out, TWINS[name], seed, threads)
    found: list[Margin] = claims(name, load(out, name, seed, threads), twins)
    return found


def table(
    out: Path, seeds: Sequence[int], threads: Sequence[int], names: Sequence[str] = tuple(SCENARIOS)
) -> str:
    """A markdown table: per scenario in ``names`` and margin, its bound and its value in every
    run."""
    runs = [(s, n) for s in seeds for n in threads]
    head = " | ".join(f"s{s} t{n}" for s, n in runs)
    lines = [f"| scenario | margin | bound | {head} |", "|---" * (3 + len(runs)) + "|"]
    for name in names:
        per_run = [margins(out, name, s, n) for s, n in runs]
        for i, first in enumerate(per_run[0]):
            values = " | ".join(
                f"{m[i].value:.3g}" if m[i].holds else f"**{m[i].value:.3g}**" for m in per_run
            )
            what = first.what.replace("|", "\\|")  # a margin's name may hold |x|
            lines.append(f"| {name} | {what} | {first.op} {first.bound:.3g} | {values} |")
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        seed, threads, where, *names = sys.argv[2:]
        _train(int(seed), int(threads), Path(where), names)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--threads", type=int, nargs="+", default=list(THREADS))
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--jobs", type=int, default=2, help="processes at a time")
    parser.add_argument("--out", type=Path, help="keep the curves here (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        sweep(args.seeds, args.threads, out, args.jobs, args.scenarios)
        # Values in bold break their claim.
        print(table(out, args.seeds, args.threads, args.scenarios))


if __name__ == "__main__":
    main()
