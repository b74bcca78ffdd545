"""Step-time overhead of monitoring, measured in one process with the modes interleaved.

    python benchmarks/overhead.py [--layers 4 12] [--rounds 3] [--steps 30]
    python benchmarks/overhead.py --accelerator cuda --precision bf16-mixed --layers 12 \
        --width 768 --block-size 1024 --batch-size 8          # GPT-2 small shape on a GPU

For the reference GPT at each depth, trains with a real Lightning ``Trainer`` in each mode:
``none`` (no callback); ``observe``, ``protect`` (the default) and ``auto``
(``StabilityMonitor(policy=...)``); ``grad_norm``: Lightning's ``grad_norm`` utility logged every
step (what its docs recommend); ``sync``: a bare per-step host read of the loss (what a naive
monitor costs on a GPU: the step waits for the device); optionally ``detect_anomaly``.

GPU-honest timing: each run times a window of ``--steps`` steps after ``--warmup`` steps, with a
device sync at the window's two ends only (none per step: a per-step sync would hide exactly the
waits the monitor must not add). Modes are interleaved round by round so that drifts of a shared
machine hit them alike; the table shows the median over rounds of each mode's time per step and
its ratio to ``none``. The monitor's own host time per step in the window is read from its cost
meter (the figure its end line prints: its hooks, the guard's judge inside the optimizer step,
the activation probes' hooks inside the forward): on a CPU that is the overhead, free of
step-time noise; on a GPU it is host time that overlaps the device's work unless it waits.
Then one ``protect`` run with a NaN at one step times the root-cause replay, paid only on a
failing step.

On a shared machine the wall clock also counts the time other processes took the core away from
the monitor. ``--clock thread --threads 1`` runs torch on one thread and reads the cost meter
with the thread's CPU time (``time.thread_time``) instead: the monitor's own host work, free of
preemption (the step times stay wall-clock). ``--parts`` prints the meter's parts (``measure``:
the numbers and the weights' check; ``guard``: the judge inside the step; ``report``: the
engine) per monitored mode.
Results are recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
import types
import warnings
from collections import defaultdict
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import grad_norm

from stabilizer.callbacks import StabilityMonitor
from stabilizer.callbacks.demo.datamodule import StabilizerDataModule
from stabilizer.callbacks.demo.lit_gpt import LitGPT
from stabilizer.callbacks.demo.run import precision_args
from stabilizer.demo.config import GPTConfig
from stabilizer.step import cost as cost_module

MODES = ("none", "observe", "protect", "auto", "grad_norm", "sync", "detect_anomaly")
DEFAULT_MODES = MODES[:-1]
MONITORED = ("observe", "protect", "auto")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class WindowTimer(pl.Callback):
    """Wall clock from the start of batch `warmup` to the start of batch `warmup + steps`, and
    the monitor's own measure of its host time over the same window (`CostMeter`).

    One device sync at each end, none in between; everything of the window's steps (the
    monitor's deferred work for its last step included) falls inside.
    """

    def __init__(self, warmup: int, steps: int, monitor: Any) -> None:
        self.warmup, self.steps, self.monitor = warmup, steps, monitor
        self.batches, self.elapsed, self.hooks, self._t = 0, 0.0, 0.0, 0.0
        self._h: dict[str, float] = {}
        self.parts: dict[str, float] = {}  # the meter's parts over the window (seconds)

    def _monitor_seconds(self) -> dict[str, float]:
        run = self.monitor.run if self.monitor is not None else None
        return dict(run.cost.seconds) if run is not None else {}

    def on_train_batch_start(self, *args: Any) -> None:
        if self.batches in (self.warmup, self.warmup + self.steps):
            _sync()
            now, spent = time.perf_counter(), self._monitor_seconds()
            if self.batches == self.warmup:
                self._t, self._h = now, spent
            else:
                self.parts = {k: v - self._h.get(k, 0.0) for k, v in spent.items()}
                self.elapsed, self.hooks = now - self._t, sum(self.parts.values())
        self.batches += 1


class ReadLoss(pl.Callback):
    """Mode ``sync``: the loss read on the host every step (a device sync on a GPU)."""

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, *a: Any
    ) -> None:
        float(outputs["loss"])


class LogGradNorm(pl.Callback):
    """What Lightning's docs recommend: ``grad_norm`` of every parameter, logged every step."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        pl_module.log_dict(grad_norm(pl_module, norm_type=2))


class NaNOnce(pl.Callback):
    """A NaN in the last block's MLP output at one step: the monitor replays that step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_fit_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        def hook(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor | None:
            return out * float("nan") if trainer.global_step == self.step else None

        pl_module.model.blocks[-1].mlp.register_forward_hook(hook)


def run_mode(
    mode: str, config: GPTConfig, args: argparse.Namespace, parts: dict[str, float] | None = None
) -> tuple[float, float]:
    """Time per step (s) over the window, and host time per step inside the monitor's hooks
    (each part's, per step, added to `parts` when given).

    Mode ``replay``: ``protect`` with a NaN at step 2; returns the root-cause replay's time
    instead of the hooks' time.
    """
    policy = mode if mode in MONITORED else "protect"
    monitor = (
        StabilityMonitor(policy=policy, jsonl=False) if mode in (*MONITORED, "replay") else None
    )
    timer = WindowTimer(args.warmup, args.steps, monitor)
    extra: dict[str, list[pl.Callback]] = {
        "grad_norm": [LogGradNorm()],
        "sync": [ReadLoss()],
        "replay": [NaNOnce(2)],
    }
    callbacks: list[pl.Callback] = [timer, *extra.get(mode, [])]
    callbacks += [monitor] if monitor is not None else []
    total = args.warmup + args.steps + 1
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_steps=total,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        detect_anomaly=mode == "detect_anomaly",
        callbacks=callbacks,
        **precision_args(args.precision, args.accelerator),
    )
    data = StabilizerDataModule(
        block_size=config.block_size, batch_size=args.batch_size, max_steps=total
    )
    trainer.fit(LitGPT(config, lr=1e-3, max_steps=total), datamodule=data)
    per_step = timer.elapsed / args.steps
    if mode == "replay":
        assert monitor is not None
        (cause,) = [f for f in monitor.findings if f.kind == "root_cause"]
        return per_step, float(cause.evidence["elapsed_s"])
    if parts is not None:
        parts.update({k: v / args.steps for k, v in timer.parts.items() if v > 0})
    return per_step, timer.hooks / args.steps


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 12])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=None, help="default: width / 64, >= 4")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before the window")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=MODES)
    parser.add_argument("--no-replay", action="store_true", help="skip the root-cause timing")
    parser.add_argument(
        "--clock", choices=("wall", "thread"), default="wall",
        help="the monitor's host time: wall clock, or the thread's CPU time (with --threads 1)",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--parts", action="store_true", help="print the meter's parts")
    return parser.parse_args()


def _use_clock(clock: str) -> None:
    """The cost meter reads the thread's CPU time: preemption by other processes left out."""
    if clock == "thread":
        cpu = types.SimpleNamespace(perf_counter=time.thread_time)
        cost_module.time = cpu  # type: ignore[attr-defined,assignment]


def main() -> None:
    args = _arguments()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    _use_clock(args.clock)
    device = torch.cuda.get_device_name() if args.accelerator == "cuda" else "cpu"
    print(
        f"# {device}, {args.precision}, torch threads {torch.get_num_threads()}, "
        f"load {os.getloadavg()[0]:.1f}, {args.rounds} rounds x {args.steps} steps, "
        f"monitor's host time by the {args.clock} clock"
    )
    print(
        f"{'layers':>6} {'mode':>15} {'median step (ms)':>17} {'ratio':>7} "
        f"{'in monitor hooks (ms/step)':>27} {'hooks / none':>13}"
    )
    heads = args.heads or max(4, args.width // 64)
    for n_layer in args.layers:
        config = replace(
            GPTConfig(), n_layer=n_layer, n_head=heads, n_embd=args.width,
            block_size=args.block_size,
        )  # fmt: skip
        times: dict[str, list[float]] = {m: [] for m in args.modes}
        hooks: dict[str, list[float]] = {m: [] for m in args.modes}
        parts: dict[str, defaultdict[str, list[float]]] = {m: defaultdict(list) for m in args.modes}
        for _ in range(args.rounds):
            for mode in args.modes:
                got: dict[str, float] = {}
                step, hook = run_mode(mode, config, args, got)
                times[mode].append(step)
                hooks[mode].append(hook)
                for name, seconds in got.items():
                    parts[mode][name].append(seconds)
        base = statistics.median(times[args.modes[0]])
        for mode in args.modes:
            med, hook = statistics.median(times[mode]), statistics.median(hooks[mode])
            extra = f"{hook * 1e3:>27.2f} {hook / base:>12.2%}" if mode in MONITORED else ""
            print(f"{n_layer:>6} {mode:>15} {med * 1e3:>17.2f} {med / base:>6.3f}x {extra}")
        if args.parts:
            _print_parts(n_layer, parts)
        if not args.no_replay:
            step, replay = run_mode("replay", config, args)
            print(
                f"{n_layer:>6} root-cause replay on the failing step: {replay * 1e3:.1f} ms "
                f"(a training step: {step * 1e3:.1f} ms); 0 on every other step"
            )
    print(f"# load at the end {os.getloadavg()[0]:.1f}")


def _print_parts(n_layer: int, parts: dict[str, defaultdict[str, list[float]]]) -> None:
    """Each monitored mode's parts of its host time: median ms per step over the rounds."""
    for mode, by_part in parts.items():
        if by_part:
            cells = ", ".join(
                f"{name} {statistics.median(v) * 1e3:.2f}"
                for name, v in sorted(by_part.items(), key=lambda kv: -statistics.median(kv[1]))
            )
            print(f"{n_layer:>6} {mode:>15} parts (ms/step): {cells}")


if __name__ == "__main__":
    main()
