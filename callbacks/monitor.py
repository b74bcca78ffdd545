"""``StabilityMonitor``: the live feed. Probes each optimizer step, runs the engine, reports."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from stabilizer.core.detectors import default_detectors
from stabilizer.core.detectors.base import Detector
from stabilizer.core.engine import Engine
from stabilizer.core.records import Finding, StepRecord
from stabilizer.live.preflight import preflight_switches
from stabilizer.live.probes import ActivationProbe, GradProbe
from stabilizer.live.rootcause import RngState, capture_rng
from stabilizer.outputs.jsonl import JsonlWriter
from stabilizer.outputs.notify import Notifier, as_notifier

from .auto import AutoRemedies
from .checks import causal_check, config_checks, root_cause
from .console import Console
from .guard import BAD_GRADS, BAD_LOSS, UNCHECKED, StepGuard, decide
from .measure import Measured, measure
from .tensorboard_output import TensorBoardOutput

__all__ = ["StabilityMonitor"]

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
                                  (none for a group without any gradient at the step)
    ``nonfinite_grads``           number of parameters whose gradient holds NaN/Inf
    ``lr``                        learning rate of the first parameter group
    ``lr/pg2``, ``lr/pg3`` ..     the other parameter groups' (numbered as Lightning's
                                  ``LearningRateMonitor`` numbers them: ``pg1`` is ``lr``)
    ``loss_scale``, ``skipped``   fp16 grad scaler's scale; 1 when the step's update was skipped
    ``nonfinite_update``          1 when the guard undid an update that made weights non-finite
    ``clip_val``, ``clipped``     gradient clipping threshold; 1 when clipping fired
    ``act_absmax/<module>``       max |activation| (norm inputs, attention, MLP), at the sampled
                                  steps only (every ``activation_every``)
    ``finding/<kind>``            severity (20 info .. 50 critical) at the step of a finding
    ============================  ==============================================================

    ``update_ratio/<group>`` (a signal the readers know) is not measured live: it would need a
    copy of the weights before each step.

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

    On a GPU the step never waits for Python: the numbers travel to the host in one
    non-blocking copy; ``protect`` waits for that copy only to decide whether to skip, and the
    engine, loggers, JSONL and console work of a step runs during the next step's backward (and
    at the end of training for the last step). Findings may then come one step late; skip
    decisions never do. On the CPU everything happens at the step itself.

    Args:
        policy: ``"protect"``, ``"observe"`` or ``"auto"``.
        detectors: The detectors to run (default: all registered, with default settings).
        grouping: ``parameter name -> depth group``, to override the naming conventions.
        activation_every: Sample activation maxima every N steps (0: never).
        heatmap_every: Write the per-layer heatmap image every N steps (0: only at the end).
        jsonl: Path of the JSONL log; default ``<trainer.log_dir>/stability.jsonl``, or without
            a logger ``<default_root_dir>/stability_logs/version_<N>/stability.jsonl``, a new
            version each run (a run resumed from a checkpoint appends to its own); ``False``
            for none.
        strict: Raise on an internal error of the monitor instead of warning once (training goes
            on either way when ``False``: an error in reporting stops the reports, never the
            protection; a step the guard cannot check is skipped).
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
        notify: Send findings (rank 0) from a background thread, once per episode: a webhook
            URL (Slack, Mattermost, Discord's ``/slack``), or a
            `stabilizer.outputs.notify.Notifier` (a command, the level, ...); None: send none.
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
        self._console = Console(policy)
        self.root_causes = 0  # localizations run
        self._batch: tuple[Any, int] | None = None  # the step's batch, for a root-cause replay
        self._rng: RngState | None = None
        self._extra: list[Finding] = []  # preflight findings, reported with the first step
        self._preflight_done = False
        self.guard = StepGuard(guard_optimizer) if policy != "observe" else None
        self.auto = (auto or AutoRemedies()) if policy == "auto" else None
        self.bad_in_a_row = 0  # consecutive non-finite (or unchecked) steps
        self.skipped_steps = 0  # optimizer steps skipped, by the guard or by a grad scaler
        self.engine = Engine(list(detectors) if detectors is not None else default_detectors())
        self.findings: list[Finding] = []
        self._grads: GradProbe | None = None
        self._acts: ActivationProbe | None = None
        self._loss: torch.Tensor | None = None
        # Report a step one step late, once the device has later work queued: None decides by
        # the device (CUDA: yes); the tests force it on the CPU.
        self._defer: bool | None = None
        self._step: Measured | None = None  # the step in flight: measured, not yet stepped
        self._pending: Measured | None = None  # stepped, its reports deferred to the next step
        self._fit: tuple[pl.Trainer, pl.LightningModule] | None = None
        self._writer: JsonlWriter | None = None
        self._jsonl_path: Path | None = None  # the default JSONL of this run, kept for a resume
        self._tb: TensorBoardOutput | None = None
        self._reporting = True  # False after an internal error in reporting
        self._warned: set[str] = set()
        self._notifier = as_notifier(notify)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(policy=self.policy)

    # --- Lightning hooks: each delegates ------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.auto is not None:  # before Trainer(ckpt_path=...) restores the weights
            self.auto.watch(pl_module)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit = trainer, pl_module
        self._start(trainer, pl_module)
        self._report_safely(self._open_outputs, trainer, pl_module)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.guard is not None:
            self.guard.skip = self.guard.last_reverted = False
            if self.root_cause and self.root_causes < self.MAX_ROOT_CAUSES:
                self._batch, self._rng = (batch, batch_idx), capture_rng()
        if any(self.preflight.values()) and not self._preflight_done:
            self._preflight_done = True
            self._report_safely(self._preflight, trainer, pl_module, batch)
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
        step = self._measure(trainer)  # the numbers are on their way to the host
        self._report_pending(trainer, pl_module)  # the last step's, while the device works
        # As the step will use it: after the remedies so far.
        factor = self.auto.lr.factor if self.auto is not None else 1.0
        step.note(trainer, optimizer, factor, self.guard is not None)
        step.found, self._extra, self._step = self._extra, [], step
        if self.guard is not None:
            self._protect(trainer, pl_module, step)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        step, self._step = self._step, None
        if step is None:  # an accumulating micro-batch: no optimizer step yet
            return
        step.reverted = self.guard is not None and self.guard.last_reverted
        if self._deferred(step):
            self._pending = step
        else:
            self._report_safely(self._report, trainer, pl_module, step)
        if self.guard is not None:
            self._count(trainer, step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report_pending(trainer, pl_module)
        self._report_safely(self._finish, trainer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._release()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # The run died (or was interrupted): keep what was measured; every line is flushed.
        with contextlib.suppress(Exception):
            self._report_pending(trainer, pl_module)
        if self._writer is not None:
            self._writer.close()
        if self._notifier is not None:
            self._notifier.close()
        self._release()

    def _release(self) -> None:
        self._fit = None
        if self.guard is not None:
            self.guard.uninstall()
        if self.auto is not None:
            self.auto.stop()

    def state_dict(self) -> dict[str, Any]:
        if self._fit is not None:  # a checkpoint holds every step up to it, as on the CPU
            self._report_pending(*self._fit)
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
            "jsonl": str(self._jsonl_path) if self._jsonl_path is not None else None,
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
        jsonl = state_dict.get("jsonl")
        self._jsonl_path = Path(jsonl) if jsonl else None

    # --- protection: at the step itself ---------------------------------------------------------

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            if self.guard is not None:
                for problem in self.guard.install(trainer.optimizers):
                    log.warning("StabilityMonitor cannot protect this run: %s", problem)
            if self.auto is not None:
                self.auto.start(trainer, pl_module)
            self._grads = GradProbe(pl_module, trainer.optimizers, self.grouping)
            self._acts = ActivationProbe(pl_module) if self.activation_every else None
        except Exception as e:
            if self.strict:
                raise
            # Without probes every step is unmeasured: `protect` skips them all, loudly.
            log.error("StabilityMonitor could not start: %r", e, exc_info=True)

    def _measure(self, trainer: pl.Trainer) -> Measured:
        loss, self._loss = self._loss, None
        try:
            if self._grads is None:
                raise RuntimeError("the gradient probe could not be built at fit start")
            return measure(trainer, self._grads, self._acts, loss)
        except Exception as e:
            if self.strict:
                raise
            if "measure" not in self._warned:
                self._warned.add("measure")
                log.warning("StabilityMonitor cannot measure the steps: %r", e, exc_info=True)
            return Measured.failed(trainer.global_step, e)

    def _protect(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: Measured) -> None:
        assert self.guard is not None
        stepping_past = self.auto is not None and self.auto.skip.active(step.step)
        # Identical on every rank: the numbers were reduced. The one wait of the step.
        skip, reason = decide(step.guard_values(), scaled=step.scaled, stepping_past=stepping_past)
        self.guard.skip = step.skip = skip
        step.bad = reason in (BAD_LOSS, BAD_GRADS, UNCHECKED)
        if reason == UNCHECKED and self.bad_in_a_row == 0:
            step.found.append(step.unchecked())
        elif step.bad and self.bad_in_a_row == 0:
            self._report_safely(self._root_cause, trainer, pl_module, step)

    def _count(self, trainer: pl.Trainer, step: Measured) -> None:
        """Skips and bad steps in a row: every rank counts the same, so every rank stops."""
        self.skipped_steps += int(step.skipped)
        self.bad_in_a_row = self.bad_in_a_row + 1 if step.bad or step.reverted else 0
        if self.stop_after is not None and self.bad_in_a_row >= self.stop_after:
            why = "unchecked" if step.numbers is None else "non-finite"
            self._stop(trainer, step.step, f"{self.bad_in_a_row} {why} steps in a row")

    def _stop(self, trainer: pl.Trainer, step: int, why: str) -> None:
        """Stop gracefully: every rank counted the same steps, so every rank stops."""
        trainer.should_stop = True
        ckpt = trainer.checkpoint_callback
        path = getattr(ckpt, "last_model_path", "") or getattr(ckpt, "best_model_path", "")
        where = f"; last checkpoint: {path}" if path else "; no checkpoint was saved"
        if trainer.is_global_zero:
            log.error("stabilizer: stopping at step %d: %s (weights intact)%s", step, why, where)

    # --- reporting: at the step on the CPU, a step later on a GPU ---------------------------------

    def _deferred(self, step: Measured) -> bool:
        if self._defer is not None:
            return self._defer
        return step.numbers is not None and step.numbers.on_device

    def _report_pending(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self._report_safely(self._report, trainer, pl_module, pending)

    def _report(self, trainer: pl.Trainer, module: pl.LightningModule, step: Measured) -> None:
        values = step.values()
        record = StepRecord(step.step, values) if values is not None else None
        found = (self.engine.observe(record) if record is not None else []) + step.found
        self._emit(trainer, record, found)
        if self.auto is not None and record is not None:
            self._emit(trainer, None, self.auto.after_step(trainer, module, step.step, found))
            if self.auto.exhausted():
                self._stop(trainer, step.step, "no rollback left")

    def _open_outputs(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # `trainer.log_dir` is a broadcast under DDP: every rank must ask, or rank 0 waits forever.
        log_dir = trainer.log_dir or trainer.default_root_dir
        if not trainer.is_global_zero:
            return
        if self.jsonl is not False:
            path = self._default_jsonl(trainer, log_dir) if self.jsonl is True else None
            self._writer = JsonlWriter(path or Path(str(self.jsonl)))
        if self._grads is not None:
            path = self._writer.path if self._writer is not None else None
            self._console.start(trainer, pl_module, self._grads.groups, self.grouping, path)
        tb = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if tb and self._grads is not None:
            self._tb = TensorBoardOutput(tb[0].experiment, self._grads.groups)

    def _default_jsonl(self, trainer: pl.Trainer, log_dir: str) -> Path:
        """Beside the logs; without a logger, a new version directory per run (not on resume)."""
        if trainer.loggers:
            return Path(log_dir) / "stability.jsonl"
        if self._jsonl_path is None:  # a resumed run got its own path from the checkpoint
            root = Path(trainer.default_root_dir) / "stability_logs"
            free = next(v for v in itertools.count() if not (root / f"version_{v}").exists())
            self._jsonl_path = root / f"version_{free}" / "stability.jsonl"
        return self._jsonl_path

    def _preflight(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        # Reported with the first step's record, so that the `auto` policy sees them too. A model
        # a check cannot run on (a forward that wants more than token ids) loses that check, not
        # the others, nor the monitor.
        for check, what in ((config_checks, "config checks"), (causal_check, "causal self-check")):
            try:
                self._extra += check(trainer, pl_module, batch, self.preflight)
            except Exception as e:
                if self.strict:
                    raise
                if trainer.is_global_zero:
                    log.warning("StabilityMonitor: preflight %s skipped: %r", what, e)

    def _root_cause(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: Measured
    ) -> None:
        if self._batch is None:
            return
        batch, batch_idx = self._batch
        self._batch = None
        self.root_causes += 1
        found = root_cause(trainer, pl_module, batch, batch_idx, self._rng, self.strict)
        if found is not None:
            step.found.append(found)

    def _finish(self, trainer: pl.Trainer) -> None:
        self._emit(trainer, None, self.engine.finish())
        self._console.finish(trainer.global_step)
        if self._tb is not None:
            self._tb.close(trainer.global_step)
        if self._writer is not None:
            self._writer.close()
        if self._notifier is not None:
            self._notifier.close()

    def _emit(self, trainer: pl.Trainer, record: StepRecord | None, found: list[Finding]) -> None:
        self.findings.extend(found)
        if not trainer.is_global_zero:
            return
        if self._notifier is not None:
            self._notifier.notify(found)
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

    def _report_safely(self, fn: Callable[..., None], *args: Any) -> None:
        # An error in reporting must never kill the user's training, nor turn the protection off:
        # warn once and stop reporting.
        if not self._reporting:
            return
        try:
            fn(*args)
        except Exception as e:
            if self.strict:
                raise
            self._reporting = False
            log.warning(
                "StabilityMonitor stopped reporting after an internal error (the protection "
                "stays on): %r",
                e,
                exc_info=True,
            )
