"""Step-time overhead of monitoring, measured in one process with the modes interleaved.

    python benchmarks/overhead.py [--layers 4 12] [--rounds 3] [--steps 30] [--accelerator cpu]

For the reference GPT at each depth, trains with a real Lightning ``Trainer`` in each mode:
no callback; ``StabilityMonitor(policy="observe")``; ``StabilityMonitor()`` (``protect``, the
default: the step guard too); Lightning's ``grad_norm`` utility logged every step; and
``detect_anomaly=True``. Then one ``protect`` run with a NaN injected at one step times the
root-cause replay, the one cost that is paid only on a failing step. Modes are interleaved
round by round so that drifts of a shared machine hit them alike; the table shows the median
step time of each mode and its ratio to the baseline. Step-time ratios on a shared machine carry
a few percent of noise, so the monitor's own hooks are also timed directly: their time per step
is the overhead, free of that noise.
Results are recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings
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

MODES = ("baseline", "observe", "protect", "grad_norm", "detect_anomaly")
MONITORED = ("observe", "protect")


class StepTimer(pl.Callback):
    """Wall time from batch start to batch end (forward, backward, optimizer, callbacks)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._t = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._t)


# mypy sees stabilizer.callbacks (the callbacks/ folder, mapped at install) as Any.
class TimedMonitor(StabilityMonitor):  # type: ignore[misc]
    """``StabilityMonitor`` that also times its own hooks: the added cost, measured directly."""

    def __init__(self, policy: str = "protect") -> None:
        super().__init__(policy=policy, jsonl=False)
        self.hook_time = 0.0

    def _timed(self, hook: str, *args: Any) -> None:
        t = time.perf_counter()
        getattr(super(), hook)(*args)
        self.hook_time += time.perf_counter() - t

    def on_train_batch_start(self, *args: Any) -> None:
        self._timed("on_train_batch_start", *args)

    def on_before_backward(self, *args: Any) -> None:
        self._timed("on_before_backward", *args)

    def on_before_optimizer_step(self, *args: Any) -> None:
        self._timed("on_before_optimizer_step", *args)

    def on_train_batch_end(self, *args: Any) -> None:
        self._timed("on_train_batch_end", *args)


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
    mode: str, config: GPTConfig, steps: int, accelerator: str, precision: str
) -> tuple[float, float]:
    """Median step time (s) of ``steps`` steps, the first 5 (warm-up) left out, and the mean time
    per step spent inside the monitor's hooks (0 for the other modes).

    Mode ``replay``: ``protect`` with a NaN at step 10; returns the root-cause replay's time
    instead of the hooks' time."""
    timer = StepTimer()
    callbacks: list[pl.Callback] = [timer]
    monitor = TimedMonitor("observe" if mode == "observe" else "protect")
    if mode in (*MONITORED, "replay"):
        callbacks.append(monitor)
    if mode == "replay":
        callbacks.append(NaNOnce(10))
    elif mode == "grad_norm":
        callbacks.append(LogGradNorm())
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=steps + 5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        detect_anomaly=mode == "detect_anomaly",
        callbacks=callbacks,
        **precision_args(precision, accelerator),
    )
    data = StabilizerDataModule(block_size=config.block_size, batch_size=16, max_steps=steps + 5)
    trainer.fit(LitGPT(config, lr=1e-3, max_steps=steps + 5), datamodule=data)
    if mode == "replay":
        (cause,) = [f for f in monitor.findings if f.kind == "root_cause"]
        return statistics.median(timer.times[5:]), cause.evidence["elapsed_s"]
    return statistics.median(timer.times[5:]), monitor.hook_time / (steps + 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 12])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    print(
        f"{'layers':>6} {'mode':>15} {'median step (ms)':>17} {'ratio':>7} "
        f"{'in monitor hooks (ms/step)':>27} {'hooks / baseline':>17}"
    )
    for n_layer in args.layers:
        config = replace(
            GPTConfig(), n_layer=n_layer, n_embd=args.width, block_size=args.block_size
        )
        times: dict[str, list[float]] = {m: [] for m in args.modes}
        hooks: dict[str, list[float]] = {m: [] for m in args.modes}
        for _ in range(args.rounds):
            for mode in args.modes:
                step, hook = run_mode(mode, config, args.steps, args.accelerator, args.precision)
                times[mode].append(step)
                hooks[mode].append(hook)
        base = statistics.median(times[args.modes[0]])
        for mode in args.modes:
            med, hook = statistics.median(times[mode]), statistics.median(hooks[mode])
            extra = f"{hook * 1e3:>27.2f} {hook / base:>16.2%}" if mode in MONITORED else ""
            print(f"{n_layer:>6} {mode:>15} {med * 1e3:>17.2f} {med / base:>6.3f}x {extra}")
        step, replay = run_mode("replay", config, args.steps, args.accelerator, args.precision)
        print(
            f"{n_layer:>6} root-cause replay on the failing step: {replay * 1e3:.1f} ms "
            f"(a training step: {step * 1e3:.1f} ms); 0 on every other step"
        )


if __name__ == "__main__":
    main()
