"""``StabilityMonitor``: the live feed. Probes each optimizer step, runs the engine, reports."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from stabilizer.detectors import default_detectors
from stabilizer.detectors.base import Detector
from stabilizer.engine import Engine
from stabilizer.jsonl import JsonlWriter
from stabilizer.probes import ActivationProbe, GradProbe
from stabilizer.records import Finding, StepRecord
from stabilizer.signals import CLIP_VAL, CLIPPED, GRAD_NORM, LOSS, LOSS_SCALE, LR, SKIPPED

from .tensorboard_output import TensorBoardOutput

__all__ = ["StabilityMonitor", "format_finding"]

log = logging.getLogger("stabilizer")

_POLICIES = ("observe",)


class StabilityMonitor(pl.Callback):
    """Catch loss spikes, divergence, NaN/Inf, fp16 overflow and starved layers as they happen.

    Each optimizer step the monitor measures the signals below on the device, copies them to the
    host once, and feeds them as a :class:`~stabilizer.records.StepRecord` to the detection
    :class:`~stabilizer.engine.Engine` (the same engine ``stabilizer diagnose`` replays logs
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

    Args:
        policy: ``"observe"``: detect and report only.
        detectors: The detectors to run (default: all registered, with default settings).
        grouping: ``parameter name -> depth group``, to override the naming conventions.
        activation_every: Sample activation maxima every N steps (0: never).
        heatmap_every: Write the per-layer heatmap image every N steps (0: only at the end).
        jsonl: Path of the JSONL log; default ``<trainer.log_dir>/stability.jsonl``; ``False``
            for none.
        strict: Raise on an internal error of the monitor instead of warning once and stepping
            aside (training goes on either way when ``False``).
    """

    def __init__(
        self,
        policy: str = "observe",
        detectors: Sequence[Detector] | None = None,
        grouping: Callable[[str], str] | None = None,
        activation_every: int = 50,
        heatmap_every: int = 100,
        jsonl: str | Path | bool = True,
        strict: bool = False,
    ) -> None:
        if policy not in _POLICIES:
            raise ValueError(f"`policy` must be one of {', '.join(_POLICIES)}, got {policy!r}")
        for name, value in (
            ("activation_every", activation_every),
            ("heatmap_every", heatmap_every),
        ):
            if value < 0:
                raise ValueError(f"`{name}` must be >= 0, got {value}")
        self.policy, self.grouping, self.strict = policy, grouping, strict
        self.activation_every, self.heatmap_every, self.jsonl = (
            activation_every,
            heatmap_every,
            jsonl,
        )
        self.engine = Engine(list(detectors) if detectors is not None else default_detectors())
        self.findings: list[Finding] = []
        self._grads: GradProbe | None = None
        self._acts: ActivationProbe | None = None
        self._loss: torch.Tensor | None = None
        self._pending: StepRecord | None = None
        self._writer: JsonlWriter | None = None
        self._tb: TensorBoardOutput | None = None
        self._failed = False

    @property
    def state_key(self) -> str:
        return self._generate_state_key(policy=self.policy)

    # --- Lightning hooks: each delegates ------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._guard(self._start, trainer, pl_module)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
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

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if self._pending is not None:
            record, self._pending = self._pending, None
            self._guard(self._observe, trainer, record)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._guard(self._finish, trainer)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # The run died (or was interrupted): keep what was logged; every line is already flushed.
        if self._writer is not None:
            self._writer.close()

    def state_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine.state_dict(),
            "findings": [f.to_dict() for f in self.findings],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.engine.load_state_dict(state_dict["engine"])
        self.findings = [Finding.from_dict(f) for f in state_dict["findings"]]

    # --- the work ------------------------------------------------------------------------------

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._grads = GradProbe(pl_module.named_parameters(), self.grouping)
        self._acts = ActivationProbe(pl_module) if self.activation_every else None
        if trainer.is_global_zero and self.jsonl is not False:
            default = Path(trainer.log_dir or trainer.default_root_dir) / "stability.jsonl"
            self._writer = JsonlWriter(default if self.jsonl is True else Path(self.jsonl))
        tb = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if trainer.is_global_zero and tb:
            self._tb = TensorBoardOutput(tb[0].experiment, self._grads.groups)

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
            vec = trainer.strategy.reduce(vec, reduce_op="mean")
        # The one host sync of the step; float32 so that a replay of the logs sees these numbers.
        host = vec.cpu().numpy().astype(np.float32)
        self._loss = None
        self._pending = self._record(trainer, optimizer, host, scaler is not None, acts is not None)

    def _record(
        self,
        trainer: pl.Trainer,
        optimizer: torch.optim.Optimizer,
        host: np.ndarray,
        scaled: bool,
        sampled: bool,
    ) -> StepRecord:
        assert self._grads is not None
        n = len(self._grads.keys)
        values = dict(zip(self._grads.keys, host[:n].tolist(), strict=True))
        loss, scale = float(host[n]), float(host[n + 1])
        values[LOSS] = float(np.float32(loss / scale)) if scaled else loss
        values[LR] = float(np.float32(optimizer.param_groups[0]["lr"]))
        if scaled:
            values[LOSS_SCALE] = scale
            values[SKIPPED] = float(not np.isfinite(values[GRAD_NORM]))  # the scaler will skip
        clip = trainer.gradient_clip_val
        if clip:
            values[CLIP_VAL] = float(np.float32(clip))
            values[CLIPPED] = float(values[GRAD_NORM] > values[CLIP_VAL])
        if sampled and self._acts is not None:
            values.update(zip(self._acts.keys, host[n + 2 :].tolist(), strict=True))
        return StepRecord(trainer.global_step, values)

    def _observe(self, trainer: pl.Trainer, record: StepRecord) -> None:
        found = self.engine.observe(record)
        self._emit(trainer, record, found)

    def _finish(self, trainer: pl.Trainer) -> None:
        self._emit(trainer, None, self.engine.finish())
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
        for f in found:
            log.log(int(f.severity), "stabilizer: %s", format_finding(f))
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
