"""``StabilityMonitor``: the step in a Lightning fit — the hooks, and the Trainer as the host.

Each fit builds one `stabilizer.step.monitor.RunMonitor` (a fit starts clean; a checkpoint is how
state carries over) with the Trainer as its host (`LightningHost`) and calls it from Lightning's
hooks: a batch starts, a backward runs, an optimizer is about to step, the batch ends, the fit
ends. Everything the step does is in `stabilizer.step`, the same code under every host.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from stabilizer.core.detectors.base import Detector
from stabilizer.core.records import Finding
from stabilizer.live.remedies.swap_to_pre_ln import SwapReport
from stabilizer.outputs.notify import Notifier, as_notifier
from stabilizer.step.live_outputs import Sinks
from stabilizer.step.monitor import Options, RunMonitor, RunView
from stabilizer.step.policies import Policy, as_policy
from stabilizer.step.swap import SWAPPED, add_param_group, pre_ln_hparams, restore_pre_ln

from .host import LightningHost

__all__ = ["StabilityMonitor"]


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
    ) -> None:
        self.policy = as_policy(policy)
        self.options = Options(
            list(detectors) if detectors is not None else None, grouping, activation_every,
            heatmap_every, jsonl, strict, preflight, as_notifier(notify), cost_budget,
        )  # fmt: skip
        self.run: RunMonitor | None = None  # this fit's (the last fit's, after it)
        self._resumed: dict[str, Any] | None = None  # the checkpoint's state, for the next fit
        self._swap: SwapReport | None = None  # a swap to pre-LN re-applied from a checkpoint
        self._jsonl: Path | None = None  # the default JSONL of a resumed run

    @property
    def state_key(self) -> str:
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
        options = self.options
        if self._jsonl is not None and options.jsonl is True:
            options = dataclasses.replace(options, jsonl=self._jsonl)
        self.run = RunMonitor(host, self.policy, options, sinks)
        earlier: list[Finding] = []
        if self._resumed is not None:
            self.run.load_state_dict(self._resumed)
            earlier, self._resumed = self.run.findings, None
        self.run.start(earlier)

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
        if self.run is not None:
            self.run.end()

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
        if run is None:
            return {}
        path = run.outputs.default_path
        state = {"jsonl": str(path) if path is not None else None, SWAPPED: self._swapped}
        return run.state_dict() | state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:  # applied to the fit's monitor when it starts
            self._resumed = dict(state_dict)
            jsonl = state_dict.get("jsonl")
            self._jsonl = Path(jsonl) if jsonl else None

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
        auto = self.run.auto if self.run is not None else None
        return self._swap is not None or bool(auto and auto.applied.get("swap_to_pre_ln"))


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
