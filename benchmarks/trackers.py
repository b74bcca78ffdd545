"""How fast `diagnose` reads a run out of each tracker's store, beside the console log of the
same numbers: records per second of `read_log`, the engine left out (it costs the same).

Writes one run of ``--steps`` steps with each tracker, offline (W&B with ``WANDB_MODE=offline``,
MLflow into a SQLite store and an ``mlruns/`` tree, trackio into its project file), needs the
``trackers`` extra, and prints a table; rounds are interleaved, the best of each kept.

    .venv/bin/python benchmarks/trackers.py --steps 20000
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from stabilizer.replay.readers import read_log


def numbers(steps: int) -> list[tuple[int, float]]:
    return [(s, 2 + 4 * math.exp(-s / (steps / 5)) + 0.01 * math.sin(s)) for s in range(1, steps)]


def write_console(work: Path, points: list[tuple[int, float]]) -> str:
    path = work / "console.log"
    lines = (f"step {s} | loss {loss} | grad_norm 1.0 | lr 0.0003\n" for s, loss in points)
    path.write_text("".join(lines))
    return str(path)


def write_wandb(work: Path, points: list[tuple[int, float]]) -> str:
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    import wandb

    run = wandb.init(project="bench", dir=str(work))
    for step, loss in points:
        values = {"train/loss": loss, "train/grad_norm": 1.0, "train/learning_rate": 3e-4}
        run.log({**values, "train/global_step": step})
    run.finish()
    return str(work / "wandb" / "latest-run")


def write_mlflow(points: list[tuple[int, float]], uri: str, path: Path) -> str:
    """One run into the store at ``uri`` (found at ``path``)."""
    os.environ.update(MLFLOW_DISABLE_TELEMETRY="true", MLFLOW_ALLOW_FILE_STORE="true")
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run = client.create_run("0")
    metrics = [
        Metric(key, value, 1_714_550_400_000 + step, step)
        for step, loss in points
        for key, value in (("loss", loss), ("grad_norm", 1.0), ("learning_rate", 3e-4))
    ]
    for start in range(0, len(metrics), 900):
        client.log_batch(run.info.run_id, metrics=metrics[start : start + 900])
    return str(path)


def write_trackio(work: Path, points: list[tuple[int, float]]) -> str:
    os.environ.update(TRACKIO_DIR=str(work / "trackio"), HF_HUB_OFFLINE="1")
    import trackio

    trackio.init(project="bench", name="run")
    for step, loss in points:
        trackio.log({"train/loss": loss, "train/grad_norm": 1.0, "lr": 3e-4}, step=step)
    trackio.finish()  # type: ignore[no-untyped-call]
    return str(work / "trackio" / "bench.db")


def read_time(path: str) -> tuple[float, int]:
    start = time.perf_counter()
    count = sum(1 for _ in read_log(path))
    return time.perf_counter() - start, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    points = numbers(args.steps + 1)
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        writers: dict[str, Callable[[], str]] = {
            "console (generic)": lambda: write_console(work, points),
            "W&B run file": lambda: write_wandb(work, points),
            "MLflow mlflow.db": lambda: write_mlflow(
                points, f"sqlite:///{work / 'mlflow.db'}", work / "mlflow.db"
            ),
            "MLflow mlruns/": lambda: write_mlflow(
                points, (work / "mlruns").as_uri(), work / "mlruns"
            ),
            "trackio": lambda: write_trackio(work, points),
        }
        paths = {name: write() for name, write in writers.items()}
        best = {name: math.inf for name in paths}
        counts = dict.fromkeys(paths, 0)
        for _ in range(args.rounds):
            for name, path in paths.items():
                seconds, counts[name] = read_time(path)
                best[name] = min(best[name], seconds)
        print(f"| store ({args.steps} steps) | items | seconds | records/s |")
        print("|---|---|---|---|")
        for name in paths:
            rate = counts[name] / best[name]
            print(f"| {name} | {counts[name]} | {best[name]:.2f} | {rate:,.0f} |")


if __name__ == "__main__":
    main()
