"""``StabilityMonitor``: the step in a Lightning fit — the hooks, and the Trainer as the host.

Each fit builds one `stabilizer.step.monitor.RunMonitor` with the Trainer as its host
(`LightningHost`) and calls it from Lightning's hooks: a batch starts, a backward runs, an
optimizer is about to step, the batch ends (and the run's answer, stop or not, is acted on),
the fit ends. A fit that resumes a checkpoint, or that goes on where the last fit of the same
Trainer stopped (``fit`` → ``validate`` → ``fit``), is the run it continues: its state carries
over. Everything the step does is in `stabilizer.step`, the same code under every host.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from stabilizer.core.detectors.base import Detector
from stabilizer.core.remedies import SWAP_TO_PRE_LN
from stabilizer.live.remedies.swap_to_pre_ln import SwapReport
from stabilizer.outputs.notify import Notifier
from stabilizer.step.host import HostFacts, MicroBatch
from stabilizer.step.live_outputs import Sinks
from stabilizer.step.monitor import RunMonitor
from stabilizer.step.options import options_from, unknown_option
from stabilizer.step.policies import Policy, as_policy
from stabilizer.step.swap import SWAPPED, add_param_group, pre_ln_hparams, restore_pre_ln
from stabilizer.step.view import RunView

__all__ = ["LightningHost", "StabilityMonitor", "user_code_after"]


class StabilityMonitor(RunView, pl.Callback):
    """Catch loss spikes, divergence, NaN/Inf, fp16 overflow and starved layers as they happen.

    Each optimizer step is measured on the device, copied to the host once and fed to the
    detection :class:`~stabilizer.core.engine.Engine` (the one ``stabilizer diagnose`` replays
    logs with); records and findings go to the console (rank 0), the Trainer's loggers (under
    ``stability/``), ``stability.jsonl``, TensorBoard's extras and notifications. `Protect` (the
    default) decides inside each optimizer step, after every hook and the clipping: it skips a
    step whose loss, gradients or LR are non-finite, checks what it lets through and stops a run
    that stays non-finite (``docs/protection.md``). `Observe` only reports; `Auto` protects and
    applies the remedies (``docs/remedies.md``).

    Args:
        policy: ``Protect(...)``, ``Observe()`` or ``Auto(...)`` (`stabilizer.step.policies`),
            each with its own knobs; or the name of one, with its defaults.
        detectors: The detectors to run (default: all registered, with default settings).
        grouping: ``parameter name -> depth group``, to override the naming conventions.
        activation_every: Sample activation maxima every N steps (0: never).
        heatmap_every: Write the per-layer heatmap image every N steps (0: only at the end).
        jsonl: Path of the JSONL log; default ``<trainer.log_dir>/stability.jsonl``, or without
            a logger ``<default_root_dir>/stability_logs/version_<N>/stability.jsonl``, a new
            version each run (a resumed run appends to its own); ``False`` for none.
        strict: Raise on an internal error of the monitor instead of warning once (else an error
            in reporting stops the reports, never the protection; an unchecked step is skipped).
        preflight: At the first batch, check the configuration (``config_risk``) and run the
            causal self-check (``causal_leak``): ``True``, ``False``, or a dict that switches
            single checks off (names in `stabilizer.live.preflight.PREFLIGHT_CHECKS`).
        notify: Send findings (rank 0) from a background thread, once per episode: a webhook
            URL (Slack, Mattermost, Discord's ``/slack``) or a `Notifier`; None: none.
        cost_budget: The share of the step time the monitor may take (its own host time,
            measured, against a realistic step); above it one warning names the part that costs
            most and the knob that lowers it. None: no warning.
    """

    def __init__(
        self,
        policy: str | Policy = "protect",
        detectors: Sequence[Detector] | None = None,
        grouping: Callable[[str], str] | None = None,
        activation_every: int = 50,
        heatmap_every: int = 100,
        jsonl: str | Path | bool = True,
        strict: bool = False,
        preflight: bool | Mapping[str, bool] = True,
        notify: Notifier | str | None = None,
        cost_budget: float | None = 0.03,
        **unknown: Any,
    ) -> None:
        if unknown:
            name = next(iter(unknown))
            raise unknown_option(name, unknown[name])
        self.policy = as_policy(policy)
        self.options = options_from({
            "detectors": list(detectors) if detectors is not None else None,
            "grouping": grouping, "activation_every": activation_every,
            "heatmap_every": heatmap_every, "jsonl": jsonl, "strict": strict,
            "preflight": preflight, "notify": notify, "cost_budget": cost_budget,
        })  # fmt: skip
        self.run: RunMonitor | None = None  # this fit's (the last fit's, after it)
        self._resumed: dict[str, Any] | None = None  # the checkpoint's state, for the next fit
        self._swap: SwapReport | None = None  # a swap to pre-LN re-applied from a checkpoint

    @functools.cached_property
    def state_key(self) -> str:  # (Lightning reads it at every hook: computed once)
        return self._generate_state_key(policy=self.policy.name)

    # --- Lightning hooks: each delegates -----------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Before Trainer(ckpt_path=...) restores the weights: a model the checkpoint records as
        # swapped to pre-LN is swapped again, whatever this run's policy.
        _watch_checkpoint_loads(pl_module, self)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        host = LightningHost(trainer, pl_module, self)
        if self._swap is not None and self._swap.new_parameters and trainer.optimizers:
            # as the swap did in the checkpoint's run: its optimizer state has this group
            add_param_group(host, list(self._swap.new_parameters))
        tb = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        sinks = Sinks(
            trainer.loggers, int(getattr(trainer, "log_every_n_steps", 1)),
            tb[0].experiment if tb and trainer.is_global_zero else None,
        )  # fmt: skip
        resumed, self._resumed = self._resumed or self._continued(trainer), None
        self.run = RunMonitor(host, self.policy, self.options, sinks, resumed)
        self.run.start()

    def _continued(self, trainer: pl.Trainer) -> dict[str, Any] | None:
        """The last fit's state when this fit goes on where it stopped (the same Trainer,
        ``fit`` again after it ended): one run, not two."""
        last = self.run
        host = last.host if last is not None else None
        if last is None or not isinstance(host, LightningHost) or host.trainer is not trainer:
            return None
        return last.state_dict() if trainer.global_step > 0 else None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.run is not None:
            self.run.begin(batch, batch_idx)

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        # Under gradient accumulation Lightning hands over loss / accumulate_grad_batches for
        # each micro-batch: their sum is the step's mean loss.
        if self.run is not None:
            self.run.loss(loss)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.run is not None:
            self.run.before_step(optimizer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        # Under automatic optimization a batch that stepped nothing is accumulating.
        if self.run is not None:
            self.run.end(carry=pl_module.automatic_optimization)
            trainer.should_stop = trainer.should_stop or self.run.should_stop

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.run is not None:
            self.run.finish()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.run is not None:
            self.run.release()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # The run died (or was interrupted): keep what was measured; every line is flushed.
        if self.run is not None:
            self.run.abort()
            self.run.release()

    # --- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        run = self.run
        return run.state_dict() | {SWAPPED: self._swapped} if run is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:  # the next fit resumes it
            self._resumed = dict(state_dict)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # A module whose hyperparameters say its norm placement is built as the model it
        # became by a plain `load_from_checkpoint`.
        hparams = checkpoint.get("hyper_parameters")
        if self._swapped and isinstance(hparams, MutableMapping):
            checkpoint["hyper_parameters"] = copy.deepcopy(hparams)
            pre_ln_hparams(checkpoint["hyper_parameters"])

    @property
    def _swapped(self) -> bool:
        """Whether the model was swapped to pre-LN (in this run, or a run it resumed)."""
        applied = self.run.applied if self.run is not None else {}
        return self._swap is not None or bool(applied.get(SWAP_TO_PRE_LN))


def _watch_checkpoint_loads(pl_module: pl.LightningModule, monitor: StabilityMonitor) -> None:
    """Make ``pl_module.on_load_checkpoint`` apply a checkpoint's swap to pre-LN first (on this
    instance), and tell the monitor what it changed (its new parameters join the optimizer)."""
    original = pl_module.on_load_checkpoint
    if getattr(original, "restores_pre_ln", False):
        return

    def on_load_checkpoint(checkpoint: dict[str, Any]) -> None:
        report = restore_pre_ln(pl_module, checkpoint)
        if report.changed:
            monitor._swap = report
        original(checkpoint)

    on_load_checkpoint.restores_pre_ln = True  # type: ignore[attr-defined]
    pl_module.on_load_checkpoint = on_load_checkpoint  # type: ignore[method-assign]


class LightningHost:
    """A Lightning fit as the step's host (`stabilizer.step.host.Host`): what only the Trainer
    knows. A root-cause replay runs the LightningModule's ``training_step`` again on the kept
    batch, with stand-ins for its optimizers and schedulers, ``manual_backward`` only
    backpropagating and ``self.log`` silent.

    Args:
        trainer: The Trainer.
        module: The LightningModule it fits.
        me: The monitor's callback (code in the callbacks after it may touch the gradients).
    """

    def __init__(self, trainer: pl.Trainer, module: pl.LightningModule, me: pl.Callback) -> None:
        self.trainer, self.module = trainer, module
        self.recount = user_code_after(trainer, module, me)
        self.replays_loss = True  # the training step again: the loss as the step computed it
        # The fp16 scaler: the precision plugin's, made with the Trainer and kept for the fit.
        self.scaler: Any = getattr(trainer.precision_plugin, "scaler", None)
        # `trainer.log_dir` is a broadcast under DDP: every rank asks now, or rank 0 waits.
        log_dir = trainer.log_dir if trainer.loggers else None
        accelerator = type(trainer.accelerator).__name__.removesuffix("Accelerator").lower()
        strategy = trainer.strategy
        self.facts = HostFacts(
            precision=str(trainer.precision), accelerator=accelerator,
            devices=max(1, int(trainer.num_devices)), strategy=type(strategy).__name__,
            world_size=max(1, int(trainer.world_size)), rank=int(trainer.global_rank),
            log_dir=Path(log_dir) if log_dir else None, root_dir=Path(trainer.default_root_dir),
            sharded=isinstance(strategy, FSDPStrategy | ModelParallelStrategy),
        )  # fmt: skip

    @property
    def step(self) -> int:
        return int(self.trainer.global_step)

    @property
    def data(self) -> object | None:
        # A new object when Lightning loads the dataloaders again (a new stage, a
        # `reload_dataloaders_every_n_epochs`).
        return self.trainer.train_dataloader

    @property
    def optimizers(self) -> Sequence[torch.optim.Optimizer]:
        return self.trainer.optimizers

    @property
    def schedulers(self) -> Sequence[Any]:
        return [config.scheduler for config in self.trainer.lr_scheduler_configs]

    @property
    def clip(self) -> float | None:
        value = self.trainer.gradient_clip_val
        return float(value) if value else None

    def set_clip(self, value: float) -> None:
        self.trainer.gradient_clip_val = value  # Lightning reads it every step

    @property
    def checkpoint(self) -> str:
        ckpt = self.trainer.checkpoint_callback
        return getattr(ckpt, "last_model_path", "") or getattr(ckpt, "best_model_path", "")

    def replay(self, micro: MicroBatch, loss_scale: float) -> Callable[[], torch.Tensor]:
        """The micro-batch's training step again. Under manual optimization the step
        backpropagates itself (its loss comes back detached)."""
        trainer, module = self.trainer, self.module

        def run_step() -> torch.Tensor:
            backwarded: list[torch.Tensor] = []

            def manual_backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
                backwarded.append(loss)
                torch.autograd.backward(loss * loss_scale, *args, **kwargs)

            module.manual_backward = manual_backward  # type: ignore[method-assign]
            with trainer.precision_plugin.train_step_context():
                out = module.training_step(micro.batch, micro.index)
            if backwarded:
                return backwarded[-1].detach()
            loss = out["loss"] if isinstance(out, dict) else out
            if not isinstance(loss, torch.Tensor):
                raise TypeError(f"training_step returned {type(out).__name__}, not a loss")
            return loss

        return run_step

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """No optimizer or scheduler steps, nothing logged; under DDP the replay's backward does
        not all-reduce (the other ranks are not replaying in step). The stand-ins are instance
        attributes, which the step's sandbox undoes."""
        module = self.module
        no_sync = getattr(self.trainer.strategy.model, "no_sync", contextlib.nullcontext)
        optimizers = _inert(module.optimizers(use_pl_optimizer=False))
        schedulers = module.lr_schedulers()
        with no_sync():
            module.optimizers = lambda use_pl_optimizer=True: optimizers  # type: ignore[method-assign]
            module.lr_schedulers = lambda: _inert(schedulers)  # type: ignore[method-assign]
            module.log = module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign,assignment]
            yield


def user_code_after(trainer: pl.Trainer, pl_module: pl.LightningModule, me: pl.Callback) -> bool:
    """Whether code other than Lightning's own clipping runs between the monitor's
    ``on_before_optimizer_step`` and the optimizer step: a later callback's hook, the module's
    ``on_before_optimizer_step`` or ``configure_gradient_clipping``."""
    callbacks = list(getattr(trainer, "callbacks", []))
    later = callbacks[callbacks.index(me) + 1 :] if me in callbacks else []
    hook = pl.Callback.on_before_optimizer_step
    if any(type(cb).on_before_optimizer_step is not hook for cb in later):
        return True
    base = pl.LightningModule
    return (
        type(pl_module).on_before_optimizer_step is not base.on_before_optimizer_step
        or type(pl_module).configure_gradient_clipping is not base.configure_gradient_clipping
    )


class _Inert:
    """An optimizer or scheduler whose ``step`` and ``zero_grad`` update nothing; the rest is
    the real one's (param groups, state). A closure given to ``step`` is evaluated once (under
    manual optimization it is where the training step's forward and backward are: Lightning's
    ``opt.step(closure=closure)``), its result returned."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def step(self, *args: Any, **kwargs: Any) -> Any:
        closure = kwargs.get("closure", args[0] if args else None)
        if not callable(closure):  # (a scheduler's step takes a metric, or nothing)
            return None
        with torch.enable_grad():
            return closure()

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _inert(objs: Any) -> Any:
    if objs is None:
        return None
    if isinstance(objs, list | tuple):
        return [_Inert(o) for o in objs]
    return _Inert(objs)
