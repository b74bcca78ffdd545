"""Throughput of `stabilizer diagnose`: how fast a finished run's log becomes a report.

Generates, in a temporary directory, a log of `--lines` lines (default 200k) in every text format
(a noise line, a warning or a progress bar, every 20th) and a TensorBoard event file of
`--scalars` scalars (default 1M, one scalar per event, as Lightning writes them), then prints:

- lines/s end to end for every text format: `stabilizer.report.diagnose` (reading, detectors,
  segments, the plot history) and the text report, what ``stabilizer diagnose`` runs less the
  interpreter's start. Floor: ≥ 100k lines/s on 2 cores; and the ratio to a bare one-regex
  Python loop over the same file, timed beside it (each line decoded, one ``findall`` of its
  numbers, each a float: the least a reader in Python does a line, with no names, no step, no
  meaning, no detector). Floor: ≥ 0.2× that loop. The ratio holds on a loaded machine
  too, where lines/s do not: both run under the same load.
- TensorBoard scalars/s read by `read_log` against TensorBoard's own ``EventAccumulator`` (every
  scalar kept: ``size_guidance={"scalars": 0}``) on the same file. Floor: ≥ 3×.
- a `--big`-line nanoGPT log (default 1M) end to end. Floor: ≤ 10 s.

Each time is the median of `--rounds` runs (default 3). The machine may be shared: the table
starts with the load average and a probe of how fast Python runs right now.

    python benchmarks/diagnose_throughput.py
    python benchmarks/diagnose_throughput.py --lines 100000 --big 0 --scalars 0   # quick
    python benchmarks/diagnose_throughput.py --only megatron,fairseq
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from stabilizer.core.records import StepRecord
from stabilizer.replay.readers import read_log
from stabilizer.report import diagnose, render_text

NOISE = [
    "/usr/lib/python3.11/site-packages/torch/nn/modules/module.py:1511: UserWarning: something",
    "\x1b[32mINFO\x1b[0m saving checkpoint to out/ckpt.pt",
    " {percent:2d}%|████▌     | {step}/{total} [12:00<14:40,  6.25it/s]",
]
"""Noise lines; the progress bar counts the steps as tqdm does (a bar that stood at one count
while the records went on read as the run going back to it: a restart every 60 lines)."""


def noisy(records: Callable[[int], str], lines: int) -> Iterator[str]:
    """``lines`` lines: records with a noise line (warning, progress bar) every 20th."""
    step = 0
    for i in range(lines):
        if i % 20 == 19:
            yield NOISE[i % 3].format(step=step, total=lines, percent=100 * step // lines)
        else:
            step += 1
            yield records(step)


def loss(step: int) -> float:
    return 3.0 + 7.0 * math.exp(-step / 20000) + 0.05 * math.sin(step)


TEXT: dict[str, Callable[[int], str]] = {
    "jsonl": lambda s: json.dumps(
        {"type": "step", "step": s, "values": {"loss": loss(s), "grad_norm": 0.8, "lr": 3e-4}},
        separators=(",", ":"),
    ),
    "lightning_csv": lambda s: f"0,{0.8:.6f},{3e-4},{s},{loss(s):.6f},",
    "megatron": lambda s: (
        f" iteration {s:8d}/ 2000000 | consumed samples: {s * 512:12d} | elapsed time per "
        f"iteration (ms): 1234.5 | learning rate: 3.000E-04 | global batch size:   512 | lm loss: "
        f"{loss(s):.6E} | loss scale: 4096.0 | grad norm: 0.812 | number of skipped iterations:"
        "   0 | number of nan iterations:   0 |"
    ),
    "deepspeed": lambda s: (
        f"[2024-05-01 12:00:00,000] [INFO] [logging.py:96:log_dist] [Rank 0] step={s}, "
        "skipped=0, lr=[0.0001], mom=[(0.9, 0.999)]"
    ),
    "hf_trainer": lambda s: (
        f"{{'loss': {loss(s):.4f}, 'grad_norm': 0.8123456, 'learning_rate': 4.9e-05, "
        f"'epoch': {s / 1e6:.2f}}}"
    ),
    "fairseq": lambda s: (
        f"2024-01-01 12:00:00 | INFO | train_inner | epoch 001:  {s % 2000:5d} / 2000 "
        f"loss={loss(s):.3f}, nll_loss=9.0, ppl=512, wps=31234.5, ups=3.12, wpb=10012.3, "
        f"bsz=128, num_updates={s}, lr=0.0005, gnorm=1.234, clip=0, loss_scale=128, train_wall=32"
    ),
    "nanogpt": lambda s: f"iter {s}: loss {loss(s):.4f}, time 512.34ms, mfu 30.12%",
    "modded_nanogpt": lambda s: (
        f"step:{s}/2000000 train_loss:{loss(s):.4f} train_time:{s * 250}ms step_avg:250.12ms"
    ),
    "generic": lambda s: (
        f"2024-05-01 12:00:00,000 INFO [train] step={s} loss={loss(s):.4f} grad_norm=0.8123 "
        "lr=3.0e-04"
    ),
}


def write_text(directory: Path, lines: int, only: set[str] | None = None) -> dict[str, Path]:
    """A log of ``lines`` lines in every text format (those in ``only``, if given)."""
    paths = {}
    for name, make in TEXT.items():
        if only and name not in only:
            continue
        path = paths[name] = directory / f"{name}.log"
        with path.open("w", encoding="utf-8") as out:
            if name == "lightning_csv":
                out.write("epoch,grad_norm,lr-AdamW,step,train_loss_step,val_loss\n")
                out.writelines(make(s) + "\n" for s in range(1, lines))
            else:
                out.writelines(line + "\n" for line in noisy(make, lines))
    if not only or "hf_trainer_state" in only:
        paths["hf_trainer_state"] = write_trainer_state(directory / "trainer_state.json", lines)
    return paths


def write_trainer_state(path: Path, lines: int) -> Path:
    """A ``trainer_state.json`` of about ``lines`` lines (indent=2: 8 lines an entry)."""
    with path.open("w", encoding="utf-8") as out:
        out.write('{\n  "best_metric": null,\n  "log_history": [\n')
        entries = lines // 8
        for k in range(1, entries + 1):
            out.write(
                f'    {{\n      "epoch": {k / entries:.4f},\n      "grad_norm": 0.81,\n      '
                f'"learning_rate": 5e-05,\n      "loss": {loss(k):.4f},\n      "step": {k}\n    }}'
                + (",\n" if k < entries else "\n")
            )
        out.write('  ],\n  "max_steps": 1\n}\n')
    return path


# --- event files: CRC-32C for a million records, vectorised ---------------------------------------


def _crc_table() -> np.ndarray:
    table = np.zeros(256, dtype=np.uint32)
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table[byte] = crc
    return table


def masked_crcs(records: list[bytes]) -> list[int]:
    """TFRecord's masked CRC-32C of every record, records of one length at a time in numpy."""
    table, out = _crc_table(), [0] * len(records)
    by_length: dict[int, list[int]] = {}
    for index, data in enumerate(records):
        by_length.setdefault(len(data), []).append(index)
    for length, indices in by_length.items():
        rows = np.frombuffer(b"".join(records[i] for i in indices), np.uint8).reshape(-1, length)
        crc = np.full(len(indices), 0xFFFFFFFF, dtype=np.uint32)
        for column in range(length):
            crc = table[(crc ^ rows[:, column]) & 0xFF] ^ (crc >> 8)
        crc ^= np.uint32(0xFFFFFFFF)
        masked = ((crc >> 15) | (crc << 17)) + np.uint32(0xA282EAD8)
        for i, value in zip(indices, masked.tolist(), strict=True):
            out[i] = value
    return out


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _value(tag: bytes, number: float) -> bytes:
    body = b"\x0a" + _varint(len(tag)) + tag + b"\x15" + struct.pack("<f", number)
    return b"\x0a" + _varint(len(body)) + body


def _event(step: int, values: list[bytes]) -> bytes:
    summary = b"".join(values)
    head = b"\x09" + struct.pack("<d", 1.7e9 + step) + (b"\x10" + _varint(step) if step else b"")
    return head + b"\x2a" + _varint(len(summary)) + summary


def write_events(path: Path, scalars: int) -> int:
    """An event file of ``scalars`` scalars, one in each event (Lightning's tags); the count."""
    tags = [b"train_loss_step", b"lr-AdamW", b"grad_2.0_norm_total", b"epoch"] + [
        f"grad_2.0_norm/model.transformer.h.{i}.mlp.c_fc.weight".encode() for i in range(8)
    ]
    records = [b"\x09" + struct.pack("<d", 1.7e9) + b"\x1a\x0dbrain.Event:2"]
    rng, step, count = random.Random(0), 0, 0
    while count < scalars:
        step += 1
        records += [_event(step, [_value(t, rng.random())]) for t in tags]
        count += len(tags)
    crcs = masked_crcs(records)
    heads = [struct.pack("<Q", len(r)) for r in records]
    head_crcs = masked_crcs(heads)
    with path.open("wb") as out:
        for data, crc, head, head_crc in zip(records, crcs, heads, head_crcs, strict=True):
            out.write(head + struct.pack("<I", head_crc) + data + struct.pack("<I", crc))
    return count


# --- timing --------------------------------------------------------------------------------------


def median_seconds(work: Callable[[], object], rounds: int) -> float:
    """The median wall time of ``rounds`` runs of ``work``."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def end_to_end(path: Path) -> Callable[[], object]:
    """What ``stabilizer diagnose PATH`` does, less the interpreter's start."""
    return lambda: render_text(diagnose(str(path)))


def our_scalars(path: Path) -> int:
    return sum(len(item.values) for item in read_log(path) if isinstance(item, StepRecord))


def accumulator_scalars(path: Path) -> int:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0})
    accumulator.Reload()
    return sum(len(accumulator.Scalars(tag)) for tag in accumulator.Tags()["scalars"])


_BARE = re.compile(r"-?\d+\.?\d*(?:[eE][-+]?\d+)?")


def bare_loop(path: Path) -> Callable[[], object]:
    """One ``findall`` a line, its numbers floats: the least a Python reader of it does."""

    def work() -> int:
        count = 0
        with path.open(encoding="utf-8") as lines:
            for line in lines:
                numbers = [float(text) for text in _BARE.findall(line)]
                count += bool(numbers)
        return count

    return work


def loop_speed() -> float:
    """Nanoseconds per ``x += i`` loop iteration: how fast this Python runs right now."""
    start, x = time.perf_counter(), 0
    for i in range(2_000_000):
        x += i
    return (time.perf_counter() - start) / 2_000_000 * 1e9


Row = tuple[str, str, float, str]  # what, items, seconds, rate and verdict


def text_rows(directory: Path, lines: int, only: set[str], rounds: int) -> list[Row]:
    rows = []
    for name, path in write_text(directory, lines, only).items():
        count = sum(1 for _ in path.open("rb"))
        ours, theirs = end_to_end(path), bare_loop(path)
        both = [(median_seconds(ours, 1), median_seconds(theirs, 1)) for _ in range(rounds)]
        seconds = statistics.median(t for t, _ in both)  # (interleaved: the same load for both)
        bare = statistics.median(t for _, t in both)
        rate, ratio = count / seconds, bare / seconds
        verdict = "met" if rate >= 100_000 else "NOT met"
        against = "met" if ratio >= 0.2 else "NOT met"
        shown = f"{rate:,.0f} lines/s ({verdict}); {ratio:.2f}x a bare loop ({against} ≥ 0.2x)"
        rows.append((name, f"{count:,} lines", seconds, shown))
    return rows


def tensorboard_rows(directory: Path, scalars: int, rounds: int) -> list[Row]:
    run = directory / "tensorboard"
    run.mkdir()
    count = write_events(run / "events.out.tfevents.1.bench", scalars)
    ours = median_seconds(lambda: our_scalars(run), rounds)
    theirs = median_seconds(lambda: accumulator_scalars(run), 1)  # (slow: once)
    ratio = theirs / ours
    verdict = "met" if ratio >= 3 else "NOT met"
    return [
        ("tensorboard, read_log", f"{count:,} scalars", ours, f"{count / ours:,.0f} scalars/s"),
        ("tensorboard, EventAccumulator", f"{count:,} scalars", theirs, f"{count / theirs:,.0f}"),
        ("tensorboard, ours / theirs", "", math.nan, f"{ratio:.1f}x ({verdict} ≥ 3x)"),
    ]


def big_row(directory: Path, lines: int, rounds: int) -> Row:
    path = write_text(directory / "big", lines, {"nanogpt"})["nanogpt"]
    seconds = median_seconds(end_to_end(path), rounds)
    verdict = "met" if seconds <= 10 else "NOT met"
    return ("nanogpt, end to end", f"{lines:,} lines", seconds, f"≤ 10 s: {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, default=200_000, help="lines of each text log")
    parser.add_argument("--big", type=int, default=1_000_000, help="lines of the nanoGPT log")
    parser.add_argument("--scalars", type=int, default=1_000_000, help="scalars of the event file")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each; the median counts")
    parser.add_argument("--only", default="", help="comma-separated text formats to time")
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))
    before = loop_speed()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        (directory / "big").mkdir()
        print(f"writing the logs in {directory} ...", file=sys.stderr)
        if args.lines:
            rows += text_rows(directory, args.lines, only, args.rounds)
        if args.scalars:
            rows += tensorboard_rows(directory, args.scalars, args.rounds)
        if args.big:
            rows.append(big_row(directory, args.big, args.rounds))
    speed = (before + loop_speed()) / 2
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"load average {load} on {os.cpu_count()} cores; python probe {speed:.0f} ns a loop")
    print(
        f"iteration (a quiet core of the 2-core dev machine: ~20); median of {args.rounds} rounds"
    )
    width = max(len(row[0]) for row in rows)
    print(f"{'input':<{width}}  {'items':<18} {'seconds':>8}  rate")
    for name, items, seconds, rate in rows:
        shown = "" if math.isnan(seconds) else f"{seconds:8.2f}"
        print(f"{name:<{width}}  {items:<18} {shown:>8}  {rate}")


if __name__ == "__main__":
    main()
