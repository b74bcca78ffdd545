"""``StabilityMonitor``: the live feed. Probes each optimizer step, runs the engine, reports."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from stabilizer.core.detectors import default_detectors
from stabilizer.core.detectors.base import Detector
from stabilizer.core.engine import Engine
from stabilizer.core.records import Finding, StepRecord
from stabilizer.core.signals import (
    CLIP_VAL,
    CLIPPED,
    GRAD_NORM,
    LOSS,
    LOSS_SCALE,
    LR,
    NONFINITE_GRADS,
    NONFINITE_UPDATE,
    SKIPPED,
)
from stabilizer.live.preflight import preflight_switches
from stabilizer.live.probes import ActivationProbe, GradProbe
from stabilizer.live.rootcause import RngState, capture_rng
from stabilizer.outputs.jsonl import JsonlWriter

from .auto import AutoRemedies
from .checks import preflight, root_cause
from .console import Console
from .guard import StepGuard
from .tensorboard_output import TensorBoardOutput

__all__ = ["StabilityMonitor", "format_finding"]

log = logging.getLogger("stabilizer")

_POLICIES = ("protect", "observe", "auto")


class StabilityMonitor(pl.Callback):
    """Catch loss spikes, divergence, NaN/Inf, fp16 overflow and starved layers as they happen.

    Each optimizer step the monitor measures the signals below on the device, copies them to the
    host once, and feeds them as a :class:`~stabilizer.core.records.StepRecord` to the detection
    :class:`~stabilizer.core.engine.Engine` (the same engine ``stabilizer diagnose`` replays logs
    with). Findings go to the console (one line each, rank 0), to every logger of the Trainer,
    and with every step record to ``stability.jsonl`` beside the logs.

    ============================  ==============================================================
    key (under ``stability/``)    meaning
    ============================  ==============================================================
    ``loss``                      training loss of the step (unscaled; mean over micro-batches)
    ``grad_norm``                 total L2 gradient norm: unscaled, before clipping
    ``grad_norm/<group>``         the same per depth group: ``embed``, ``block_00``.., ``head``
    ``nonfinite_grads``           number of parameters whose gradient holds NaN/Inf
    ``lr``                        learning rate of the first parameter group
    ``loss_scale``, ``skipped``   fp16 grad scaler's scale; 1 when the scaler skips the step
    ``clip_val``, ``clipped``     gradient clipping threshold; 1 when clipping fired
    ``act_absmax/<module>``       max |activation| (norm inputs, attention, MLP), sampled steps
    ``finding/<kind>``            severity (20 info .. 50 critical) at the step of a finding
    ============================  ==============================================================

    TensorBoard also gets a custom-scalars layout (all per-layer gradient norms in one chart),
    a layers × steps heatmap image every ``heatmap_every`` steps, and findings as text.

    Policies (see ``docs/protection.md``): ``"protect"`` (default) skips the optimizer step of any
    step whose loss or gradients are non-finite (the optimizer never sees it: parameters and
    optimizer state stay untouched; ``skipped`` = 1), undoes a step that turned the weights
    non-finite (``guard_optimizer``), and stops the Trainer after ``stop_after`` non-finite steps
    in a row. ``"observe"`` only detects and reports. ``"auto"`` protects and also applies the
    remedies of :class:`~stabilizer.callbacks.auto.AutoRemedies` (clipping, fp32 norms and
    softmax, pre-LN, LR cut, rollback), each application a ``remedy_applied`` finding. The LR
    scheduler still advances on skipped steps, as it does when an fp16 grad scaler skips one.

    Args:
        policy: ``"protect"``, ``"observe"`` or ``"auto"``.
        detectors: The detectors to run (default: all registered, with default settings).
        grouping: ``parameter name -> depth group``, to override the naming conventions.
        activation_every: Sample activation maxima every N steps (0: never).
        heatmap_every: Write the per-layer heatmap image every N steps (0: only at the end).
        jsonl: Path of the JSONL log; default ``<trainer.log_dir>/stability.jsonl``; ``False``
            for none.
        strict: Raise on an internal error of the monitor instead of warning once and stepping
            aside (training goes on either way when ``False``).
        guard_optimizer: ``protect`` only: copy parameters and optimizer state before each step
            and undo the step if it made them non-finite. ``None``: when parameters are fp16 or
            bf16 (``16-true``, ``bf16-true``), where the optimizer's own arithmetic can overflow.
        stop_after: ``protect`` only: stop the Trainer (``trainer.should_stop``) after this many
            non-finite steps in a row; ``None`` never stops.
        root_cause: ``protect`` only: on the first step of each non-finite episode, replay the
            step under hooks and name the module that produced the NaN/Inf (``root_cause``
            finding; at most `MAX_ROOT_CAUSES` a run). Costs one forward+backward, then only.
        preflight: At the first training batch, check the configuration (``config_risk``) and
            run the causal self-check (``causal_leak``). ``True``, ``False``, or a dict that
            switches single checks off: ``{"causal": False}`` (names in
            `stabilizer.live.preflight.PREFLIGHT_CHECKS`).
        auto: The remedies of policy ``"auto"`` and their settings (which are allowed, snapshot
            interval, rollbacks ...); default ``AutoRemedies()``: all of them.
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
    ) -> None:
        if policy not in _POLICIES:
            raise ValueError(f"`policy` must be one of {', '.join(_POLICIES)}, got {policy!r}")
        for name, value in (
            ("activation_every", activation_every),
            ("heatmap_every", heatmap_every),
        ):
            if value < 0:
                raise ValueError(f"`{name}` must be >= 0, got {value}")
        if stop_after is not None and stop_after < 1:
            raise ValueError(f"`stop_after` must be >= 1 or None, got {stop_after}")
        self.policy, self.grouping, self.strict = policy, grouping, strict
        self.activation_every, self.heatmap_every, self.jsonl = (
            activation_every,
            heatmap_every,
            jsonl,
        )
        self.stop_after, self.root_cause = stop_after, root_cause
        self.preflight = preflight_switches(preflight)
        self.root_causes = 0  # localizations run
        self._batch: tuple[Any, int] | None = None  # the step's batch, for a root-cause replay
        self._rng: RngState | None = None
        self._extra: list[Finding] = []  # the monitor's own findings, emitted with the record
        self._preflight_done = False
        self.guard = StepGuard(guard_optimizer) if policy != "observe" else None
        self.auto = (auto or AutoRemedies()) if policy == "auto" else None
        self._nonfinite = False  # whether the step in flight is non-finite
        self.bad_in_a_row = 0  # consecutive non-finite steps
        self.skipped_steps = 0  # optimizer steps skipped, by the guard or by a grad scaler
        self.engine = Engine(list(detectors) if detectors is not None else default_detectors())
        self.findings: list[Finding] = []
        self._grads: GradProbe | None = None
        self._acts: ActivationProbe | None = None
        self._loss: torch.Tensor | None = None
        self._pending: tuple[int, dict[str, float]] | None = None  # the step's record, unsealed
        self._writer: JsonlWriter | None = None
        self._tb: TensorBoardOutput | None = None
        self._failed = False

    @property
    def state_key(self) -> str:
        return self._generate_state_key(policy=self.policy)

    # --- Lightning hooks: each delegates ------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.auto is not None:  # before Trainer(ckpt_path=...) restores the weights
            self.auto.watch(pl_module)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._guard(self._start, trainer, pl_module)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.guard is not None:
            self.guard.skip = self.guard.last_reverted = self._nonfinite = False
            if self.root_cause and self.root_causes < self.MAX_ROOT_CAUSES:
                self._batch, self._rng = (batch, batch_idx), capture_rng()
        if any(self.preflight.values()) and not self._preflight_done:
            self._preflight_done = True
            self._guard(self._preflight, trainer, pl_module, batch)
        every = self.activation_every
        if self._acts is not None and every and trainer.global_step % every == 0:
            self._acts.attach()

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        # Under gradient accumulation Lightning hands over loss / accumulate_grad_batches for each
        # micro-batch: their sum is the step's mean loss.
        loss = loss.detach().float()
        self._loss = loss if self._loss is None else self._loss + loss

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._guard(self._probe, trainer, optimizer)
        if self.guard is not None and self._nonfinite and self.bad_in_a_row == 0:
            self._guard(self._root_cause, trainer, pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if self._pending is not None:
            (step, values), self._pending = self._pending, None
            if self.guard is not None and self.guard.last_reverted:
                values[NONFINITE_UPDATE] = values[SKIPPED] = 1.0
            self._guard(self._observe, trainer, pl_module, StepRecord(step, values))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._guard(self._finish, trainer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._release()

    def _release(self) -> None:
        if self.guard is not None:
            self.guard.uninstall()
        if self.auto is not None:
            self.auto.stop()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # The run died (or was interrupted): keep what was logged; every line is already flushed.
        if self._writer is not None:
            self._writer.close()
        self._release()

    def state_dict(self) -> dict[str, Any]:
        guard = self.guard
        return {
            "engine": self.engine.state_dict(),
            "findings": [f.to_dict() for f in self.findings],
            "bad_in_a_row": self.bad_in_a_row,
            "skipped_steps": self.skipped_steps,
            "root_causes": self.root_causes,
            "auto": self.auto.state_dict() if self.auto is not None else None,
            "skipped": guard.skipped if guard is not None else 0,
            "reverted": guard.reverted if guard is not None else 0,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.engine.load_state_dict(state_dict["engine"])
        self.findings = [Finding.from_dict(f) for f in state_dict["findings"]]
        self.bad_in_a_row = int(state_dict.get("bad_in_a_row", 0))
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.root_causes = int(state_dict.get("root_causes", 0))
        self._preflight_done = True  # a resumed run was checked when it started
        if self.auto is not None and state_dict.get("auto"):
            self.auto.load_state_dict(state_dict["auto"])
        if self.guard is not None:
            self.guard.skipped = int(state_dict.get("skipped", 0))
            self.guard.reverted = int(state_dict.get("reverted", 0))

    # --- the work ------------------------------------------------------------------------------

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._grads = GradProbe(pl_module.named_parameters(), self.grouping)
        self._acts = ActivationProbe(pl_module) if self.activation_every else None
        # `trainer.log_dir` is a broadcast under DDP: every rank must ask, or rank 0 waits forever.
        log_dir = trainer.log_dir or trainer.default_root_dir
        if trainer.is_global_zero and self.jsonl is not False:
            default = Path(log_dir) / "stability.jsonl"
            self._writer = JsonlWriter(default if self.jsonl is True else Path(self.jsonl))
        self._console = Console(self.policy)
        path = self._writer.path if self._writer is not None else None
        self._console.start(trainer, pl_module, self._grads.groups, self.grouping, path)
        tb = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if trainer.is_global_zero and tb:
            self._tb = TensorBoardOutput(tb[0].experiment, self._grads.groups)
        if self.guard is not None:
            for problem in self.guard.install(trainer.optimizers):
                log.warning("StabilityMonitor cannot protect this run: %s", problem)
        if self.auto is not None:
            self.auto.start(trainer, pl_module)

    def _preflight(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        # Reported with the first step's record, so that the `auto` policy sees them too. A model
        # the checks cannot run on (a forward that wants more than token ids) loses the checks,
        # not the monitor.
        try:
            self._extra += preflight(trainer, pl_module, batch, self.preflight)
        except Exception as e:
            if self.strict:
                raise
            log.warning("StabilityMonitor: preflight checks skipped: %r", e)

    def _root_cause(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._batch is None:
            return
        batch, batch_idx = self._batch
        self._batch = None
        self.root_causes += 1
        found = root_cause(trainer, pl_module, batch, batch_idx, self._rng, self.strict)
        if found is not None:
            self._extra.append(found)

    def _probe(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> None:
        assert self._grads is not None, "on_fit_start builds the probes"
        grads = self._grads()
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        scale = getattr(scaler, "_scale", None) if scaler is not None else None
        parts = [grads, _scalar(self._loss, grads, math.nan), _scalar(scale, grads, 1.0)]
        acts = self._acts.detach() if self._acts is not None else None
        if acts is not None:
            parts.append(acts.to(grads.device))
        vec = torch.cat(parts)
        if trainer.world_size > 1:  # every rank must feed the engine the same numbers
            vec = self._reduce(trainer.strategy, vec, len(grads))
        # The one host sync of the step; float32 so that a replay of the logs sees these numbers.
        host = vec.cpu().numpy().astype(np.float32)
        self._loss = None
        values = self._values(trainer, optimizer, host, scaler is not None, acts is not None)
        if self.guard is not None:
            # Identical on every rank: the numbers were reduced. Overflowing gradients under a
            # grad scaler are the scaler's to skip (it never calls the optimizer then).
            loss_ok = bool(np.isfinite(values[LOSS]))
            grads_ok = np.isfinite(values[GRAD_NORM]) and values[NONFINITE_GRADS] == 0
            self._nonfinite = not loss_ok or (not grads_ok and scaler is None)
            stepping_past = self.auto is not None and self.auto.skip.active(trainer.global_step)
            self.guard.skip = self._nonfinite or stepping_past
            values[SKIPPED] = float(self.guard.skip or values.get(SKIPPED, 0.0) >= 0.5)
        self._pending = (trainer.global_step, values)

    @staticmethod
    def _reduce(strategy: Any, vec: torch.Tensor, n: int) -> torch.Tensor:
        """Mean over ranks; a NaN anywhere makes it NaN everywhere, so all ranks decide alike.

        Sharded parameters (FSDP): each rank holds a shard of every gradient, so the norms are
        partial: their squares are summed over ranks (then the square root), the rest averaged.
        """
        if not isinstance(strategy, FSDPStrategy | ModelParallelStrategy):
            return cast(torch.Tensor, strategy.reduce(vec, reduce_op="mean"))
        norms = strategy.reduce(GradProbe.sharded_squares(vec[:n]), reduce_op="sum")
        rest = strategy.reduce(vec[n:], reduce_op="mean")
        return torch.cat((GradProbe.from_squares(norms), rest))

    def _values(
        self,
        trainer: pl.Trainer,
        optimizer: torch.optim.Optimizer,
        host: np.ndarray,
        scaled: bool,
        sampled: bool,
    ) -> dict[str, float]:
        assert self._grads is not None
        n = len(self._grads.keys)
        values = dict(zip(self._grads.keys, host[:n].tolist(), strict=True))
        loss, scale = float(host[n]), float(host[n + 1])
        values[LOSS] = float(np.float32(loss / scale)) if scaled else loss
        factor = self.auto.lr.factor if self.auto is not None else 1.0  # as the step will use it
        values[LR] = float(np.float32(optimizer.param_groups[0]["lr"] * factor))
        if scaled:
            values[LOSS_SCALE] = scale
            values[SKIPPED] = float(not np.isfinite(values[GRAD_NORM]))  # the scaler will skip
        clip = trainer.gradient_clip_val
        if clip:
            values[CLIP_VAL] = float(np.float32(clip))
            values[CLIPPED] = float(values[GRAD_NORM] > values[CLIP_VAL])
        if sampled and self._acts is not None:
            values.update(zip(self._acts.keys, host[n + 2 :].tolist(), strict=True))
        return values

    def _observe(self, trainer: pl.Trainer, module: pl.LightningModule, record: StepRecord) -> None:
        found = self.engine.observe(record) + self._extra
        self._extra = []
        self._emit(trainer, record, found)
        if self.auto is not None:
            self._emit(trainer, None, self.auto.after_step(trainer, module, record.step, found))
            if self.auto.exhausted():
                self._stop(trainer, record.step, "no rollback left")
        if self.guard is None:
            return
        self.skipped_steps += int(record.values[SKIPPED] >= 0.5)
        bad = self._nonfinite or self.guard.last_reverted
        self.bad_in_a_row = self.bad_in_a_row + 1 if bad else 0
        if self.stop_after is not None and self.bad_in_a_row >= self.stop_after:
            self._stop(trainer, record.step, f"{self.bad_in_a_row} non-finite steps in a row")

    def _stop(self, trainer: pl.Trainer, step: int, why: str) -> None:
        """Stop gracefully: every rank counted the same steps, so every rank stops."""
        trainer.should_stop = True
        ckpt = trainer.checkpoint_callback
        path = getattr(ckpt, "last_model_path", "") or getattr(ckpt, "best_model_path", "")
        where = f"; last checkpoint: {path}" if path else "; no checkpoint was saved"
        if trainer.is_global_zero:
            log.error("stabilizer: stopping at step %d: %s (weights intact)%s", step, why, where)

    def _finish(self, trainer: pl.Trainer) -> None:
        self._emit(trainer, None, self.engine.finish())
        self._console.finish(trainer.global_step)
        if self._tb is not None:
            self._tb.close(trainer.global_step)
        if self._writer is not None:
            self._writer.close()

    def _emit(self, trainer: pl.Trainer, record: StepRecord | None, found: list[Finding]) -> None:
        self.findings.extend(found)
        if not trainer.is_global_zero:
            return
        if record is not None:
            metrics = {f"stability/{k}": v for k, v in record.values.items()}
            for f in found:
                metrics[f"stability/finding/{f.kind}"] = float(f.severity)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=record.step)
        for item in ([record] if record is not None else []) + list(found):
            if self._writer is not None:
                self._writer.write(item)
        self._console.report(record, found)
        if self._tb is not None:
            self._tb.update(record, found, self.heatmap_every)

    def _guard(self, fn: Callable[..., None], *args: Any) -> None:
        # The monitor must never kill the user's training: warn once and step aside.
        if self._failed:
            return
        try:
            fn(*args)
        except Exception as e:
            if self.strict:
                raise
            self._failed = True
            log.warning("StabilityMonitor disabled after an internal error: %r", e, exc_info=True)


def _scalar(value: torch.Tensor | None, like: torch.Tensor, default: float) -> torch.Tensor:
    if value is None:
        return torch.full((1,), default, device=like.device)
    return value.detach().float().reshape(1).to(like.device)


def format_finding(f: Finding) -> str:
    """One line for a human: step range, severity, kind, location, message, remedies."""
    where = f" [{', '.join(f.location)}]" if f.location else ""
    span = f"step {f.step}" if f.end_step in (None, f.step) else f"steps {f.step}-{f.end_step}"
    fix = f" -> try: {', '.join(f.remedies)}" if f.remedies else ""
    return f"{span} {f.severity.name.lower()} {f.kind}{where}: {f.message}{fix}"
