"""``StabilityMonitor``: the live feed. Probes each optimizer step, runs the engine, reports.

The monitor builds its parts, each in a module of its own, and wires Lightning's hooks to them:
what each hook of a batch does (`flow`), measuring a step (`measure`), the protection and its
guard inside the optimizer step (`protection`, `guard`), the reports (`reporting`) and their
outputs (`outputs`), the one-off checks (`checks`), the remedies (`auto`) and its own cost
(`cost`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from stabilizer.core.detectors import default_detectors
from stabilizer.core.detectors.base import Detector
from stabilizer.core.engine import Engine
from stabilizer.core.records import Finding
from stabilizer.live.preflight import preflight_switches
from stabilizer.live.remedies.swap_to_pre_ln import SwapReport
from stabilizer.outputs.notify import Notifier, as_notifier

from .auto import AutoRemedies
from .checks import Preflight
from .console import Console
from .cost import CostMeter
from .flow import StepFlow
from .guard import StepGuard
from .live_step import LiveStep
from .measure import Measurer, Probes
from .outputs import LiveOutputs
from .protection import Protection
from .reporting import Reporter
from .run_header import run_header
from .swap_checkpoint import SWAPPED, add_param_group, pre_ln_hparams, watch_checkpoint_loads

__all__ = ["StabilityMonitor"]

_POLICIES = ("protect", "observe", "auto")
SWAP = "swap_to_pre_ln"


@dataclass(frozen=True)
class _Settings:
    """The monitor's arguments, as given: each fit builds its parts from a copy of them."""

    detectors: list[Detector] | None
    activation_every: int
    heatmap_every: int
    jsonl: str | Path | bool
    guard_optimizer: bool | None
    stop_after: int | None
    root_cause: bool
    preflight: Mapping[str, bool]
    auto: AutoRemedies | None
    notify: Notifier | None
    cost_budget: float | None


class StabilityMonitor(pl.Callback):
    """Catch loss spikes, divergence, NaN/Inf, fp16 overflow and starved layers as they happen.

    Each optimizer step is measured on the device, copied to the host once and fed to the
    detection :class:`~stabilizer.core.engine.Engine` (the one ``stabilizer diagnose`` replays
    logs with); records and findings go to the console (rank 0), the Trainer's loggers (under
    ``stability/``), ``stability.jsonl``, TensorBoard's extras and notifications. ``"protect"``
    (the default) decides inside each optimizer step, after every hook and the clipping: it
    skips a step whose loss, gradients or LR are non-finite, checks what it lets through and
    stops a run that stays non-finite (``docs/protection.md``). ``"observe"`` only reports;
    ``"auto"`` protects and applies the remedies of `AutoRemedies` (``docs/remedies.md``).

    Args:
        policy: ``"protect"``, ``"observe"`` or ``"auto"``.
        detectors: The detectors to run (default: all registered, with default settings).
        grouping: ``parameter name -> depth group``, to override the naming conventions.
        activation_every: Sample activation maxima every N steps (0: never).
        heatmap_every: Write the per-layer heatmap image every N steps (0: only at the end).
        jsonl: Path of the JSONL log; default ``<trainer.log_dir>/stability.jsonl``, or without
            a logger ``<default_root_dir>/stability_logs/version_<N>/stability.jsonl``, a new
            version each run (a resumed run appends to its own); ``False`` for none.
        strict: Raise on an internal error of the monitor instead of warning once (else an error
            in reporting stops the reports, never the protection; an unchecked step is skipped).
        guard_optimizer: ``protect`` only: copy parameters and optimizer state before a step
            and undo the step if it made them non-finite: ``True`` every step, ``False`` none,
            ``None`` where the optimizer's own arithmetic can overflow from finite gradients
            (fp16/bf16 parameters, Adam-style ``eps=0``, a huge gradient; LBFGS always).
        stop_after: ``protect`` only: stop the Trainer after this many non-finite steps in a
            row; ``None`` never stops.
        root_cause: ``protect`` only: on the first step of each non-finite episode, replay its
            micro-batches under hooks, in a sandbox, and name the module (micro-batch, rank)
            that produced the NaN/Inf (at most `MAX_ROOT_CAUSES` a run).
        preflight: At the first batch, check the configuration (``config_risk``) and run the
            causal self-check (``causal_leak``): ``True``, ``False``, or a dict that switches
            single checks off (names in `stabilizer.live.preflight.PREFLIGHT_CHECKS`).
        auto: The remedies of policy ``"auto"`` and their settings; default ``AutoRemedies()``.
        notify: Send findings (rank 0) from a background thread, once per episode: a webhook
            URL (Slack, Mattermost, Discord's ``/slack``) or a `Notifier`; None: none.
        cost_budget: The share of the step time the monitor may take (its own host time,
            measured); above it one warning names the part that costs most and the knob that
            lowers it. The end line and the JSONL's last line say the cost. None: no warning.
    """

    MAX_ROOT_CAUSES = 10

    def __init__(
        self,
        policy: str = "protect",
        detectors: Sequence[Detector] | None = None,
        grouping: Callable[[str], str] | None = None,
        activation_every: int = 50,
        heatmap_every: int = 100,
        jsonl: str | Path | bool = True,
        strict: bool = False,
        guard_optimizer: bool | None = None,
        stop_after: int | None = 10,
        root_cause: bool = True,
        preflight: bool | Mapping[str, bool] = True,
        auto: AutoRemedies | None = None,
        notify: Notifier | str | None = None,
        cost_budget: float | None = 0.03,
    ) -> None:
        _check_arguments(policy, activation_every, heatmap_every, stop_after, cost_budget)
        self.policy, self.grouping, self.strict = policy, grouping, strict
        self._settings = _Settings(
            list(detectors) if detectors is not None else None, activation_every,
            heatmap_every, jsonl, guard_optimizer, stop_after, root_cause,
            preflight_switches(preflight), auto, as_notifier(notify), cost_budget,
        )  # fmt: skip
        self._fitted = False  # a fit has started: the next one builds the parts anew
        self._build()

    def _build(self) -> None:
        """The monitor's parts, fresh: each fit starts clean (a checkpoint is how state carries
        over: `load_state_dict` runs after this). The detectors, the remedies' settings and the
        notifier given to the monitor are copied, so that a second fit finds them as given."""
        cfg, policy, strict = copy.deepcopy(self._settings), self.policy, self.strict
        self.cost = CostMeter(cfg.cost_budget)
        self.outputs = LiveOutputs(
            Console(policy), cfg.jsonl, cfg.notify, cfg.heatmap_every, strict, self.cost.part
        )
        self.auto = (cfg.auto or AutoRemedies()) if policy == "auto" else None
        self.live = LiveStep(keep_batches=False)  # the batch in flight
        self.protection = None if policy == "observe" else Protection(
            self.live, verify=cfg.guard_optimizer, stop_after=cfg.stop_after,
            root_cause=cfg.root_cause, max_root_causes=self.MAX_ROOT_CAUSES,
            lr_factor=lambda: self.auto.lr.factor if self.auto is not None else 1.0,
            stepping_past=lambda s: self.auto is not None and self.auto.skip.active(s),
            inert=lambda: self.flow.quiet(), strict=strict, part=self.cost.part,
        )  # fmt: skip
        detectors = cfg.detectors

        def make_engine() -> Engine:  # one per optimizer, each from the detectors as given
            given = copy.deepcopy(detectors) if detectors is not None else None
            return Engine(given if given is not None else default_detectors())

        self.reporter = Reporter(
            make_engine, self.outputs, self.cost, self.auto, self.protection, strict
        )
        self.flow = StepFlow(
            self.live, Measurer(strict), self.reporter, self.cost,
            Preflight(cfg.preflight, strict), self.protection, self.auto, cfg.activation_every,
        )  # fmt: skip
        self._fit: tuple[pl.Trainer, pl.LightningModule] | None = None
        self._swap: SwapReport | None = None  # a swap to pre-LN re-applied from a checkpoint

    @property
    def state_key(self) -> str:
        return self._generate_state_key(policy=self.policy)

    @property
    def engine(self) -> Engine:
        """The detection engine (of the first optimizer's steps)."""
        return self.reporter.engine

    @property
    def probes(self) -> Probes | None:
        """The run's probes, from fit start (None if they could not be built)."""
        return self.flow.measure.probes

    @property
    def guard(self) -> StepGuard | None:
        """The optimizers' guard (policies ``protect`` and ``auto``)."""
        return self.protection.guard if self.protection is not None else None

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped (by the guard, or by an fp16 grad scaler)."""
        return self.protection.skipped_steps if self.protection is not None else 0

    @property
    def findings(self) -> list[Finding]:
        """Every finding so far (every rank), in order."""
        return self.reporter.findings

    @property
    def root_causes(self) -> int:
        """Root-cause replays run."""
        return self.protection.root_causes if self.protection is not None else 0

    # --- Lightning hooks: each delegates ------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self._fitted:  # a monitor given to a second fit: a clean start
            self._build()
        # Before Trainer(ckpt_path=...) restores the weights: a model the checkpoint records
        # as swapped to pre-LN is swapped again, whatever this run's policy.
        watch_checkpoint_loads(pl_module, self._restored)

    def _restored(self, report: SwapReport) -> None:
        self._swap = report

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
        return self._swap is not None or bool(self.auto and self.auto.applied.get(SWAP))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit, self._fitted = (trainer, pl_module), True
        if self._swap is not None and self._swap.new_parameters and trainer.optimizers:
            # as the swap did in the checkpoint's run: its optimizer state has this group
            add_param_group(trainer, list(self._swap.new_parameters))
        self.flow.fit_start(trainer, pl_module, self, self.grouping)
        groups = self.probes.grads.groups if self.probes is not None else None
        header = run_header(trainer, self.policy, groups or ())
        self.reporter.safely(self.engine.set_run, header)  # (an fp32 run has no fp16 range)
        self.reporter.safely(
            self.outputs.open, trainer, pl_module, groups, self.grouping, self.findings,
            self.policy,
        )  # fmt: skip

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.flow.batch_start(trainer, pl_module, batch, batch_idx)

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        self.flow.before_backward(loss)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self.flow.before_optimizer_step(trainer, pl_module, optimizer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self.flow.batch_end(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.flow.train_end(trainer, pl_module)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._release()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # The run died (or was interrupted): keep what was measured; every line is flushed.
        with contextlib.suppress(Exception):
            self.reporter.pending(trainer, pl_module)
        self.outputs.abort()
        self._release()

    def _release(self) -> None:
        self._fit = None
        self.flow.release()

    def state_dict(self) -> dict[str, Any]:
        if self._fit is not None:  # a checkpoint holds every step up to it, as on the CPU
            self.reporter.pending(*self._fit)
        path = self.outputs.default_path
        state = {"jsonl": str(path) if path is not None else None, SWAPPED: self._swapped}
        return self.reporter.state_dict() | state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.reporter.load_state_dict(state_dict)
        self.flow.preflight.done = True  # a resumed run was checked when it started
        jsonl = state_dict.get("jsonl")
        self.outputs.default_path = Path(jsonl) if jsonl else None


def _check_arguments(
    policy: str, activation_every: int, heatmap_every: int, stop_after: int | None,
    cost_budget: float | None,
) -> None:  # fmt: skip
    wrong = [
        (policy not in _POLICIES, "policy", f"one of {', '.join(_POLICIES)}", policy),
        (activation_every < 0, "activation_every", ">= 0", activation_every),
        (heatmap_every < 0, "heatmap_every", ">= 0", heatmap_every),
        (stop_after is not None and stop_after < 1, "stop_after", ">= 1 or None", stop_after),
        (
            cost_budget is not None and not cost_budget > 0,
            "cost_budget",
            "> 0 or None",
            cost_budget,
        ),
    ]
    for bad, name, what, value in wrong:
        if bad:
            raise ValueError(f"`{name}` must be {what}, got {value!r}")
