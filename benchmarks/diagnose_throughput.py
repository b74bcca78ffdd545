"""Throughput of the log readers: how fast a finished run's log becomes step records.

Generates, in a temporary directory, a log of `--lines` lines (default 1M) in every text format
and a TensorBoard event file of `--scalars` scalars (default 1M, one scalar per event as
Lightning writes them, plus a file in the monitor's own layout, all of a step in one event),
then times reading each with `stabilizer.replay.readers.read_log`, TensorBoard's own
``EventAccumulator`` (every scalar kept) on the same event file, and the nanoGPT log diagnosed:
``Engine().replay(read_log(...))``, and `stabilizer.report.diagnose` (what ``stabilizer
diagnose`` runs: reading, detectors, segments, the plot history; without the interpreter's start
and the rendering, ~0.4 s). Prints a table: format, items, seconds, items per second.

    python benchmarks/diagnose_throughput.py                 # the full run
    python benchmarks/diagnose_throughput.py --lines 200000 --scalars 200000 --no-accumulator
    python benchmarks/diagnose_throughput.py --only megatron,fairseq   # some formats only

Targets on 2 CPU cores: ≥ 300k text lines/s, ≥ 300k TB scalars/s, a 1M-line log diagnosed in
under 5 s.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from stabilizer.core.engine import Engine
from stabilizer.replay.readers import read_log
from stabilizer.report import diagnose

NOISE = [
    "/usr/lib/python3.11/site-packages/torch/nn/modules/module.py:1511: UserWarning: something",
    "\x1b[32mINFO\x1b[0m saving checkpoint to out/ckpt.pt",
    " 45%|████▌     | 4500/10000 [12:00<14:40,  6.25it/s]",
]


def noisy(records: Callable[[int], str], lines: int) -> Iterator[str]:
    """``lines`` lines: records with a noise line (warning, progress bar) every 20th."""
    step = 0
    for i in range(lines):
        if i % 20 == 19:
            yield NOISE[i % 3]
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


def write_text(directory: Path, lines: int) -> dict[str, Path]:
    paths = {}
    for name, make in TEXT.items():
        path = paths[name] = directory / f"{name}.log"
        with path.open("w", encoding="utf-8") as out:
            if name == "lightning_csv":
                out.write("epoch,grad_norm,lr-AdamW,step,train_loss_step,val_loss\n")
                out.writelines(make(s) + "\n" for s in range(1, lines))
            else:
                out.writelines(line + "\n" for line in noisy(make, lines))
    state = paths["hf_trainer_state"] = directory / "trainer_state.json"
    with state.open("w", encoding="utf-8") as out:  # indent=2: 8 lines an entry
        out.write('{\n  "best_metric": null,\n  "log_history": [\n')
        entries = lines // 8
        for k in range(1, entries + 1):
            out.write(
                f'    {{\n      "epoch": {k / entries:.4f},\n      "grad_norm": 0.81,\n      '
                f'"learning_rate": 5e-05,\n      "loss": {loss(k):.4f},\n      "step": {k}\n    }}'
                + (",\n" if k < entries else "\n")
            )
        out.write('  ],\n  "max_steps": 1\n}\n')
    return paths


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


def write_events(path: Path, scalars: int, per_event: int) -> int:
    """An event file of ``scalars`` scalars, ``per_event`` in each event; returns the count."""
    tags = [b"train_loss_step", b"lr-AdamW", b"grad_2.0_norm_total", b"epoch"] + [
        f"grad_2.0_norm/model.transformer.h.{i}.mlp.c_fc.weight".encode() for i in range(8)
    ]
    if per_event > 1:
        tags = [b"stability/" + t for t in (b"loss", b"grad_norm", b"lr", b"loss_scale")] + [
            f"stability/grad_norm/block_{i:02d}".encode() for i in range(per_event - 4)
        ]
    records = [b"\x09" + struct.pack("<d", 1.7e9) + b"\x1a\x0dbrain.Event:2"]
    rng, step, count = random.Random(0), 0, 0
    while count < scalars:
        step += 1
        if per_event == 1:
            records += [_event(step, [_value(t, rng.random())]) for t in tags]
        else:
            records.append(_event(step, [_value(t, rng.random()) for t in tags]))
        count += len(tags)
    crcs = masked_crcs(records)
    heads = [struct.pack("<Q", len(r)) for r in records]
    head_crcs = masked_crcs(heads)
    with path.open("wb") as out:
        for data, crc, head, head_crc in zip(records, crcs, heads, head_crcs, strict=True):
            out.write(head + struct.pack("<I", head_crc) + data + struct.pack("<I", crc))
    return count


# --- timing --------------------------------------------------------------------------------------


def timed(work: Callable[[], int], repeat: int = 1) -> tuple[int, float]:
    """``(what work() counted, its best time in seconds)`` over ``repeat`` runs."""
    best, count = math.inf, 0
    for _ in range(repeat):
        start = time.perf_counter()
        count = work()
        best = min(best, time.perf_counter() - start)
    return count, best


def count_records(path: Path) -> Callable[[], int]:
    return lambda: sum(1 for _ in read_log(path))


def count_values(path: Path) -> Callable[[], int]:
    return lambda: sum(len(r.values) for r in read_log(path))


def accumulator(path: Path) -> Callable[[], int]:
    def run() -> int:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        return sum(len(acc.Scalars(tag)) for tag in acc.Tags()["scalars"])

    return run


def loop_speed() -> float:
    """Nanoseconds per ``x += i`` loop iteration: how fast this Python runs right now."""
    start, x = time.perf_counter(), 0
    for i in range(2_000_000):
        x += i
    return (time.perf_counter() - start) / 2_000_000 * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, default=1_000_000, help="lines of each text log")
    parser.add_argument("--scalars", type=int, default=1_000_000, help="scalars of the event file")
    parser.add_argument("--repeat", type=int, default=2, help="runs per reader; the best counts")
    parser.add_argument("--no-accumulator", action="store_true", help="skip EventAccumulator")
    parser.add_argument("--no-engine", action="store_true", help="skip the end-to-end diagnosis")
    parser.add_argument(
        "--only", default="", help="comma-separated formats to time (text formats, tensorboard)"
    )
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))
    rows: list[tuple[str, str, int, float]] = []
    speed = loop_speed()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        print(f"writing the logs in {directory} ...", file=sys.stderr)
        paths = write_text(directory, args.lines)
        lightning, monitor = directory / "lightning", directory / "monitor"
        lightning.mkdir()
        monitor.mkdir()
        write_events(lightning / "events.out.tfevents.1.bench", args.scalars, 1)
        write_events(monitor / "events.out.tfevents.1.bench", args.scalars, 20)
        for name, path in paths.items():
            if only and name not in only:
                continue
            lines = sum(1 for _ in path.open("rb"))
            records, seconds = timed(count_records(path), args.repeat)
            rows.append((name, f"{lines:,} lines → {records:,} records", lines, seconds))
        for label, run in (
            ("tensorboard (1 scalar/event)", lightning),
            ("tensorboard (20/event)", monitor),
        ):
            if only and "tensorboard" not in only:
                continue
            scalars, seconds = timed(count_values(run), args.repeat)
            rows.append((label, f"{scalars:,} scalars (mapped)", scalars, seconds))
        if not args.no_accumulator and (not only or "tensorboard" in only):
            scalars, seconds = timed(accumulator(lightning))
            rows.append(
                ("EventAccumulator (1 scalar/event)", f"{scalars:,} scalars", scalars, seconds)
            )
        if not args.no_engine and (not only or "nanogpt" in only):
            path = paths["nanogpt"]
            lines = sum(1 for _ in path.open("rb"))
            _, seconds = timed(lambda: len(Engine().replay(read_log(path))) + lines)
            rows.append(("diagnose nanogpt (read + Engine)", f"{lines:,} lines", lines, seconds))
            _, seconds = timed(lambda: diagnose(str(path)).history.records + lines)
            rows.append(("diagnose nanogpt (report.diagnose)", f"{lines:,} lines", lines, seconds))
    speed = (speed + loop_speed()) / 2
    print(f"python speed: {speed:.0f} ns a loop iteration (quiet core: ~35); best of {args.repeat}")
    width = max(len(r[0]) for r in rows)
    print(f"{'format':<{width}}  {'items':<36} {'seconds':>8} {'per second':>12}")
    for name, items, count, seconds in rows:
        print(f"{name:<{width}}  {items:<36} {seconds:8.2f} {count / seconds:12,.0f}")


if __name__ == "__main__":
    main()
