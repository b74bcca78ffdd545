"""Peak memory of training with and without the monitor, each run in a fresh process.

    python benchmarks/memory.py [--host loop|lightning] [--runs 3] [--modes none protect]
    python benchmarks/memory.py --accelerator cuda --layers 12 --width 768 \
        --block-size 1024 --batch-size 8                      # GPT-2 small shape on a GPU

The reference GPT trains in each mode: ``none`` (no monitor), ``observe``, ``protect`` (the
default) and ``auto``; ``--host loop`` (default): nanoGPT's plain loop with the `Stabilizer`,
``optimizer.zero_grad(set_to_none=True)`` right after each step, so that a gradient anything
still holds during the next forward and backward is a second copy of the model's gradients;
``--host lightning``: a real Lightning ``Trainer`` with `StabilityMonitor` (Lightning itself
keeps the gradients until the next step's backward). Each run is a process of its own; after
``--warmup`` steps its peak is reset and ``--steps`` more are measured:

- ``peak``: on the CPU the resident set's high-water mark (``VmHWM``, reset through
  ``/proc/self/clear_refs``; glibc is told to map every block of 64 KiB or more on its own,
  ``MALLOC_MMAP_THRESHOLD_``, so that a freed tensor leaves the resident set at once); on CUDA
  ``torch.cuda.max_memory_allocated``. The step's peak is reached in the forward and backward:
  activations, the gradients being written and whatever is still held from the step before.
- ``held``: the bytes of every tensor storage alive at the end of the last step (found through
  ``gc``): the model, the optimizer state (and under Lightning the gradients, kept until the
  next step), and what the monitor keeps (the buffers' copies, for a skipped step's restore).

The table shows medians over ``--runs`` and each mode's difference to ``none``: what the monitor
costs in memory. Results are recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

MODES = ("none", "observe", "protect", "auto")
_MMAP = "65536"  # bytes: glibc maps blocks from this size on (and unmaps them when freed)


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--host", choices=("loop", "lightning"), default="loop")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=None, help="default: width / 64, >= 4")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3, help="processes per mode")
    parser.add_argument("--steps", type=int, default=8, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=4, help="steps before the peak is reset")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--precision", default="32-true", help="(--host lightning)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    return parser.parse_args()


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmHWM``, ``VmRSS``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _held_bytes() -> int:
    """Bytes of the tensor storages alive now (each storage once)."""
    import torch

    storages: dict[tuple[str, int], int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            storage = obj.untyped_storage()
            storages[(str(storage.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


class Window:
    """Resets the peak after the warm-up; reads it, and the bytes held, after the last step."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.found = args, dict[str, float]()

    def start(self, step: int) -> None:
        import torch

        if step == self.args.warmup:
            gc.collect()
            if self.args.accelerator == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            else:
                Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS

    def end(self, step: int) -> None:
        import torch

        if step == self.args.warmup + self.args.steps:
            if self.args.accelerator == "cuda":
                torch.cuda.synchronize()
                self.found["peak"] = torch.cuda.max_memory_allocated()
            else:
                self.found["peak"] = _status("VmHWM")
            self.found["held"] = _held_bytes()


def _config(args: argparse.Namespace) -> Any:
    from stabilizer.demo.config import GPTConfig

    heads = args.heads or max(4, args.width // 64)
    return replace(
        GPTConfig(), n_layer=args.layers, n_head=heads, n_embd=args.width,
        block_size=args.block_size,
    )  # fmt: skip


def loop_child(mode: str, args: argparse.Namespace) -> dict[str, float]:
    """One run of nanoGPT's loop, in this process (`--host loop`)."""
    import contextlib

    import torch

    from stabilizer import Stabilizer
    from stabilizer.demo.data import RandomWindows, load_corpus
    from stabilizer.demo.model import GPT

    torch.manual_seed(0)
    config, device = _config(args), torch.device(args.accelerator)
    total, window = args.warmup + args.steps, Window(args)
    data = RandomWindows(load_corpus().train, config.block_size, args.batch_size, total, seed=0)
    model = GPT(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stab = Stabilizer(model, optimizer, mode, jsonl=False) if mode != "none" else None
    for step in range(total):
        window.start(step)
        x, y = (t.to(device) for t in data[step])
        with stab.step() if stab is not None else contextlib.nullcontext():
            _, loss = model(x, y)
            stab.backward(loss) if stab is not None else loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        del x, y, loss
        window.end(step + 1)
    if stab is not None:
        stab.close()
    return window.found


def lightning_child(mode: str, args: argparse.Namespace) -> dict[str, float]:
    """One run under a Lightning ``Trainer``, in this process (`--host lightning`)."""
    import lightning.pytorch as pl

    from stabilizer.callbacks import StabilityMonitor
    from stabilizer.callbacks.demo.datamodule import StabilizerDataModule
    from stabilizer.callbacks.demo.lit_gpt import LitGPT
    from stabilizer.callbacks.demo.run import precision_args

    window = Window(args)

    class Hooks(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
            window.start(trainer.global_step)

        def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
            window.end(trainer.global_step)

    config, total = _config(args), args.warmup + args.steps
    monitor = [StabilityMonitor(policy=mode, jsonl=False)] if mode != "none" else []
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=1, max_steps=total, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=[Hooks(), *monitor],
        **precision_args(args.precision, args.accelerator),
    )  # fmt: skip
    data = StabilizerDataModule(
        block_size=config.block_size, batch_size=args.batch_size, max_steps=total
    )
    trainer.fit(LitGPT(config, lr=1e-3, max_steps=total), datamodule=data)
    return window.found


def _run(mode: str, args: argparse.Namespace) -> dict[str, float]:
    argv = [a for a in sys.argv[1:] if a != "--modes" and a not in MODES]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": _MMAP}
    done = subprocess.run(
        [sys.executable, __file__, *argv, "--child", mode],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"mode {mode} failed:\n{done.stderr[-2000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    args = _arguments()
    if args.child:
        import logging
        import warnings

        logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
        logging.getLogger("stabilizer").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore")
        child = loop_child if args.host == "loop" else lightning_child
        print(json.dumps(child(args.child, args)))
        return
    what = "CUDA max_memory_allocated" if args.accelerator == "cuda" else "VmHWM"
    print(
        f"# {args.host}, {args.accelerator}, {args.precision}, {args.layers} layers x "
        f"{args.width}, {args.runs} runs x {args.steps} steps, peak = {what}, "
        f"load {os.getloadavg()[0]:.1f}"
    )
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in args.modes}
    for _ in range(args.runs):
        for mode in args.modes:  # interleaved: a drift of the machine hits every mode alike
            runs[mode].append(_run(mode, args))
    mib = 2**20
    peak = {m: statistics.median(r["peak"] for r in runs[m]) / mib for m in args.modes}
    held = {m: statistics.median(r["held"] for r in runs[m]) / mib for m in args.modes}
    base = args.modes[0]
    print(f"{'mode':>8} {'peak (MiB)':>11} {'vs ' + base:>9} {'held (MiB)':>11} {'vs ' + base:>9}")
    for m in args.modes:
        print(
            f"{m:>8} {peak[m]:>11.1f} {peak[m] - peak[base]:>+9.1f} "
            f"{held[m]:>11.1f} {held[m] - held[base]:>+9.1f}"
        )


if __name__ == "__main__":
    main()
