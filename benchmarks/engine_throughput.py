"""Throughput of the detection engine alone: `Engine().replay` over step records already in memory.

Two streams of a healthy-looking run (noisy falling loss, log-normal gradient norms, a probing fp16
scaler, clipping now and then), built before the clock starts:

- (a) `--small` records of 3 keys: ``loss``, ``grad_norm``, ``lr`` (default 1M);
- (b) `--wide` records of 21 keys: those, ``loss_scale``, ``skipped``, ``clipped``,
  ``nonfinite_grads`` and ``grad_norm/<group>`` for embed, block_00..block_11 and head
  (default 200k).

Each is replayed `--repeat` times by a fresh default engine; the best time counts. Prints a table:
stream, records, keys, seconds, records per second, microseconds per record.

    python benchmarks/engine_throughput.py
    python benchmarks/engine_throughput.py --small 200000 --wide 50000 --repeat 1

Target on 2 CPU cores: ≲ 3 µs per record, so that a 1M-line log (reading it costs 1-4 µs a
line) is diagnosed in under 5 s.
"""

from __future__ import annotations

import argparse
import math
import random
import time

from stabilizer.core.engine import Engine
from stabilizer.core.records import StepRecord

__all__ = ["main", "small_records", "timed", "wide_records"]


def _basics(rng: random.Random, step: int) -> dict[str, float]:
    loss = (3.0 + 7.0 * math.exp(-step / 20000)) * (1.0 + rng.gauss(0.0, 0.03))
    norm = (0.5 + 2.0 * math.exp(-step / 5000)) * math.exp(rng.gauss(0.0, 0.2))
    lr = 3e-4 * min(1.0, (step + 1) / 2000) * (0.55 + 0.45 * math.cos(step / 1e6 * math.pi))
    return {"loss": loss, "grad_norm": norm, "lr": lr}


def small_records(n: int, seed: int = 0) -> list[StepRecord]:
    """``n`` records of ``loss``, ``grad_norm`` and ``lr``."""
    rng = random.Random(seed)
    return [StepRecord(step, _basics(rng, step)) for step in range(n)]


def wide_records(n: int, seed: int = 0) -> list[StepRecord]:
    """``n`` records of 21 keys: the basics, an fp16 scaler, clipping and 14 group norms."""
    rng = random.Random(seed)
    scale, stream = 65536.0, []
    for step in range(n):
        values = _basics(rng, step)
        skipped = step < 4 or step % 2000 == 1  # start-up calibration, then probing
        scale = scale / 2 if skipped else scale * 2 if step % 2000 == 0 and step else scale
        values.update(loss_scale=scale, skipped=float(skipped), nonfinite_grads=0.0)
        values["clipped"] = float(rng.random() < 0.1)
        values["grad_norm/embed"] = 0.3 * math.exp(rng.gauss(0.0, 0.3))
        for i in range(12):
            values[f"grad_norm/block_{i:02d}"] = 10 ** (1 - i / 11) * math.exp(rng.gauss(0, 0.3))
        values["grad_norm/head"] = 0.5 * math.exp(rng.gauss(0.0, 0.3))
        stream.append(StepRecord(step, values))
    return stream


def timed(records: list[StepRecord], repeat: int) -> float:
    """The best of ``repeat`` wall times (seconds) of a fresh `Engine().replay(records)`."""
    best = math.inf
    for _ in range(repeat):
        engine = Engine()
        start = time.perf_counter()
        engine.replay(records)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    """Parse the arguments, build both streams, time them and print the table."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--small", type=int, default=1_000_000, help="records of 3 keys")
    parser.add_argument("--wide", type=int, default=200_000, help="records of 21 keys")
    parser.add_argument("--repeat", type=int, default=3, help="replays per stream (best counts)")
    args = parser.parse_args()
    print(
        f"{'stream':<28} {'records':>9} {'keys':>5} {'seconds':>8} {'records/s':>10} {'µs/rec':>7}"
    )
    for name, make, n in (
        ("(a) loss, grad_norm, lr", small_records, args.small),
        ("(b) + scaler, clip, groups", wide_records, args.wide),
    ):
        records = make(n)
        seconds = timed(records, args.repeat)
        keys = len(records[0].values) if records else 0
        rate = n / seconds if seconds > 0 else math.inf
        per = 1e6 * seconds / n if n else 0.0
        print(f"{name:<28} {n:>9} {keys:>5} {seconds:>8.2f} {rate:>10,.0f} {per:>7.2f}")


if __name__ == "__main__":
    main()
