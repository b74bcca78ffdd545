"""``StabilityMonitor``: the live feed. Probes each optimizer step, runs the engine, reports."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
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
from stabilizer.live.sandbox import sandbox
from stabilizer.outputs.jsonl import JsonlWriter
from stabilizer.outputs.notify import Notifier, as_notifier

from .auto import AutoRemedies
from .checks import causal_check, config_checks
from .console import Console
from .guard import StepGuard
from .live_step import LiveStep
from .measure import Measured, measure
from .protection import Protection
from .run_header import run_header
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
    ``nonfinite_weights``         protect/auto: parameters, optimizer-state tensors and buffers
                                  holding NaN/Inf before the step (the last update's check)
    ``clip_val``, ``clipped``     gradient clipping threshold; 1 when clipping fired
    ``act_absmax/<module>``       max |activation| (norm inputs, attention, MLP), at the sampled
                                  steps only (every ``activation_every``)
    ``finding/<kind>``            severity (20 info .. 50 critical) at the step of a finding
    ============================  ==============================================================

    ``update_ratio/<group>`` (a signal the readers know) is not measured live: it would need a
    copy of the weights before each step.

    TensorBoard also gets a custom-scalars layout (all per-layer gradient norms in one chart),
    a layers × steps heatmap image every ``heatmap_every`` steps, and findings as text.

    Policies (see ``docs/protection.md``): ``"protect"`` (default) decides inside each
    optimizer step, after every hook and the clipping, and skips a step whose loss, gradients or
    LR are non-finite (the optimizer never sees it: parameters, optimizer state and buffers stay
    untouched; ``skipped`` = 1); copies and checks a step whose arithmetic can overflow
    (``guard_optimizer``); checks every step's result in the next step's measurement; and stops
    the Trainer after ``stop_after`` bad steps in a row, or at once when the weights are found
    non-finite. ``"observe"`` only detects and reports. ``"auto"`` protects and also applies the
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
        guard_optimizer: ``protect`` only: copy parameters and optimizer state before a step
            and undo the step if it made them non-finite: ``True`` every step, ``False`` none,
            ``None`` where the optimizer's own arithmetic can overflow from finite gradients
            (fp16/bf16 parameters, Adam-style ``eps=0``, a huge gradient; LBFGS always).
        stop_after: ``protect`` only: stop the Trainer (``trainer.should_stop``) after this many
            non-finite steps in a row; ``None`` never stops.
        root_cause: ``protect`` only: on the first step of each non-finite episode, replay the
            step's micro-batches under hooks, in a sandbox, and name the module (and
            micro-batch, and rank) that produced the NaN/Inf (``root_cause`` finding; at most
            `MAX_ROOT_CAUSES` a run). Costs a forward+backward per micro-batch, then only.
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
        self._extra: list[Finding] = []  # preflight findings, reported with the first step
        self._preflight_done = False
        self.auto = (auto or AutoRemedies()) if policy == "auto" else None
        self.live = LiveStep(keep_batches=False)  # the batch in flight
        self.protection = (
            Protection(
                self.live,
                verify=guard_optimizer,
                stop_after=stop_after,
                root_cause=root_cause,
                max_root_causes=self.MAX_ROOT_CAUSES,
                lr_factor=lambda: self.auto.lr.factor if self.auto is not None else 1.0,
                stepping_past=lambda s: self.auto is not None and self.auto.skip.active(s),
                inert=self._sandboxed,
                strict=strict,
            )
            if policy != "observe"
            else None
        )
        self.engine = Engine(list(detectors) if detectors is not None else default_detectors())
        self.findings: list[Finding] = []
        self._grads: GradProbe | None = None  # every optimizer's tensors: the run's depth groups
        self._probes: dict[int, GradProbe] = {}  # one per optimizer, when there are several
        self._acts: ActivationProbe | None = None
        self._inert = False  # the monitor's own replay or preflight is running: hooks ignore it
        # Report a step one step late, once the device has later work queued: None decides by
        # the device (CUDA: yes); the tests force it on the CPU.
        self._defer: bool | None = None
        self._pending: Measured | None = None  # stepped, its reports deferred to the next step
        self._fit: tuple[pl.Trainer, pl.LightningModule] | None = None
        self._writer: JsonlWriter | None = None
        self._jsonl_path: Path | None = None  # the default JSONL of this run, kept for a resume
        self._tb: TensorBoardOutput | None = None
        self._reporting = True  # False after an internal error in reporting
        self._broken: set[str] = set()  # outputs stopped by an error of their own
        self._warned: set[str] = set()
        self._notifier = as_notifier(notify)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(policy=self.policy)

    @property
    def guard(self) -> StepGuard | None:
        """The optimizers' guard (policies ``protect`` and ``auto``)."""
        return self.protection.guard if self.protection is not None else None

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped (by the guard, or by an fp16 grad scaler)."""
        return self.protection.skipped_steps if self.protection is not None else 0

    @property
    def root_causes(self) -> int:
        """Root-cause replays run."""
        return self.protection.root_causes if self.protection is not None else 0

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
        if self.protection is not None:
            self.protection.begin_batch(trainer, batch, batch_idx)
        else:
            self.live.begin(batch, batch_idx, None)  # the micro-batches' losses, nothing kept
        if any(self.preflight.values()) and not self._preflight_done:
            self._preflight_done = True
            self._preflight(trainer, pl_module, batch)
        every = self.activation_every
        if self._acts is not None and every and trainer.global_step % every == 0:
            self._acts.attach()

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        # Under gradient accumulation Lightning hands over loss / accumulate_grad_batches for each
        # micro-batch: their sum is the step's mean loss.
        if not self._inert:
            self.live.add_loss(loss)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._inert:
            return
        if self._evaluating_again(optimizer):
            self.live.step_loss()  # that evaluation's loss belongs to the step measured once
            return
        step = self._measure(trainer, optimizer)  # the numbers are on their way to the host
        self._report_pending(trainer, pl_module)  # the last step's, while the device works
        # As the step will use it: after the remedies so far.
        factor = self.auto.lr.factor if self.auto is not None else 1.0
        step.note(trainer, optimizer, factor, self.protection is not None)
        step.found, self._extra = self._extra, []
        self.live.add(optimizer, step)
        if self.protection is not None:
            self.protection.measured(optimizer, step)  # the guard decides inside the step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        steps = self.live.end()
        if not steps:  # an accumulating micro-batch: no optimizer step yet
            return
        if self.protection is not None:
            self.protection.end_batch(trainer, steps)
        for step in steps:
            if self._deferred(step):
                self._report_pending(trainer, pl_module)
                self._pending = step
            else:
                self._report_safely(self._report, trainer, pl_module, step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report_pending(trainer, pl_module)
        if self.protection is not None:
            found = self.protection.finish(trainer, pl_module)
            if found:
                self._report_safely(self._emit, trainer, None, found)
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
        if self.protection is not None:
            self.protection.guard.uninstall()
        if self.auto is not None:
            self.auto.stop()

    def state_dict(self) -> dict[str, Any]:
        if self._fit is not None:  # a checkpoint holds every step up to it, as on the CPU
            self._report_pending(*self._fit)
        prot = self.protection
        return {
            "engine": self.engine.state_dict(),
            "findings": [f.to_dict() for f in self.findings],
            "bad_in_a_row": prot.bad_in_a_row if prot is not None else 0,
            "skipped_steps": self.skipped_steps,
            "root_causes": self.root_causes,
            "auto": self.auto.state_dict() if self.auto is not None else None,
            "skipped": prot.guard.skipped if prot is not None else 0,
            "reverted": prot.guard.reverted if prot is not None else 0,
            "jsonl": str(self._jsonl_path) if self._jsonl_path is not None else None,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.engine.load_state_dict(state_dict["engine"])
        self.findings = [Finding.from_dict(f) for f in state_dict["findings"]]
        self._preflight_done = True  # a resumed run was checked when it started
        if self.auto is not None and state_dict.get("auto"):
            self.auto.load_state_dict(state_dict["auto"])
        prot = self.protection
        if prot is not None:
            prot.bad_in_a_row = int(state_dict.get("bad_in_a_row", 0))
            prot.skipped_steps = int(state_dict.get("skipped_steps", 0))
            prot.root_causes = int(state_dict.get("root_causes", 0))
            prot.guard.skipped = int(state_dict.get("skipped", 0))
            prot.guard.reverted = int(state_dict.get("reverted", 0))
        jsonl = state_dict.get("jsonl")
        self._jsonl_path = Path(jsonl) if jsonl else None

    # --- measuring: at the step itself ----------------------------------------------------------

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            if self.protection is not None:
                self.protection.start(trainer, pl_module, self)
            if self.auto is not None:
                self.auto.start(trainer, pl_module)
            self._grads = GradProbe(pl_module, trainer.optimizers, self.grouping)
            self._acts = ActivationProbe(pl_module) if self.activation_every else None
        except Exception as e:
            if self.strict:
                raise
            # Without probes every step is unmeasured: `protect` skips them all, loudly.
            log.error("StabilityMonitor could not start: %r", e, exc_info=True)

    def _evaluating_again(self, optimizer: torch.optim.Optimizer) -> bool:
        """A closure evaluated again inside one step (LBFGS): the step was measured once."""
        step = self.live.current(optimizer)
        guard = self.guard
        return (
            guard is not None
            and guard.evaluating is optimizer
            and step is not None
            and (not step.judged)
        )

    def _probe(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> GradProbe:
        if self._grads is None or self._fit is None:
            raise RuntimeError("the gradient probe could not be built at fit start")
        if len(trainer.optimizers) <= 1:
            return self._grads
        probe = self._probes.get(id(optimizer))
        if probe is None:  # each optimizer's step is measured on the tensors it updates
            module = self._fit[1]
            probe = GradProbe(module, [optimizer], self.grouping, only_optimizers=True)
            self._probes[id(optimizer)] = probe
        return probe

    def _measure(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> Measured:
        loss = self.live.step_loss()
        try:
            probe = self._probe(trainer, optimizer)
            prot = self.protection
            if prot is None:
                return measure(trainer, probe, self._acts, loss)
            return measure(trainer, probe, self._acts, loss, optimizer, prot.buffers_nonfinite)
        except Exception as e:
            if self.strict:
                raise
            if "measure" not in self._warned:
                self._warned.add("measure")
                log.warning("StabilityMonitor cannot measure the steps: %r", e, exc_info=True)
            return Measured.failed(trainer.global_step, e)

    @contextlib.contextmanager
    def _sandboxed(self) -> Iterator[None]:
        """The monitor's own forwards (replay, preflight): its hooks ignore them."""
        self._inert = True
        try:
            yield
        finally:
            self._inert = False

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
            done = self.auto.after_step(trainer, module, step.step, found, record)
            self._emit(trainer, None, done)
            if self.auto.exhausted() and self.protection is not None:
                self.protection.stop(trainer, step, self.auto.stop_reason)

    def _open_outputs(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # `trainer.log_dir` is a broadcast under DDP: every rank must ask, or rank 0 waits forever.
        log_dir = trainer.log_dir or trainer.default_root_dir
        if not trainer.is_global_zero:
            return
        if self.jsonl is not False:
            path = self._default_jsonl(trainer, log_dir) if self.jsonl is True else None
            self._output("jsonl", self._open_jsonl, path or Path(str(self.jsonl)), trainer)
        if self._grads is not None:
            path = self._writer.path if self._writer is not None else None
            self._console.start(trainer, pl_module, self._grads.groups, self.grouping, path)
        tb = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if tb and self._grads is not None:
            groups = self._grads.groups  # the table lists the findings before a resume too
            self._tb = TensorBoardOutput(tb[0].experiment, groups, earlier=self.findings)

    def _open_jsonl(self, path: Path, trainer: pl.Trainer) -> None:
        self._writer = JsonlWriter(path)
        groups = self._grads.groups if self._grads is not None else ()
        self._writer.write(run_header(trainer, self.policy, groups))  # the run's facts first

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
        # the others, nor the monitor. The checks run the model in a sandbox: nothing stays.
        guard = self.guard
        for check, what in ((config_checks, "config checks"), (causal_check, "causal self-check")):
            try:
                with (
                    self._sandboxed(),
                    sandbox(pl_module),
                    guard.inert() if guard is not None else contextlib.nullcontext(),
                ):
                    self._extra += check(trainer, pl_module, batch, self.preflight)
            except Exception as e:
                if self.strict:
                    raise
                if trainer.is_global_zero:
                    log.warning("StabilityMonitor: preflight %s skipped: %r", what, e)

    def _finish(self, trainer: pl.Trainer) -> None:
        self._emit(trainer, None, self.engine.finish())
        prot = self.protection
        intact = prot.intact if prot is not None else None
        self._output(
            "console", self._console.finish, trainer.global_step, self.skipped_steps, intact
        )
        if self._tb is not None:
            self._output("tensorboard", self._tb.close, trainer.global_step)
        if self._writer is not None:
            self._output("jsonl", self._writer.close)
        if self._notifier is not None:
            self._output("notify", self._notifier.close)

    def _emit(self, trainer: pl.Trainer, record: StepRecord | None, found: list[Finding]) -> None:
        self.findings.extend(found)
        if not trainer.is_global_zero:
            return
        if self._notifier is not None:
            self._output("notify", self._notifier.notify, found)
        if record is not None:
            metrics = {f"stability/{k}": v for k, v in record.values.items()}
            for f in found:
                metrics[f"stability/finding/{f.kind}"] = float(f.severity)
            for logger in trainer.loggers:
                self._output("loggers", logger.log_metrics, metrics, step=record.step)
        if self._writer is not None:
            for item in ([record] if record is not None else []) + list(found):
                self._output("jsonl", self._writer.write, item)
        self._output("console", self._console.report, record, found)
        if self._tb is not None:
            self._output("tensorboard", self._tb.update, record, found, self.heatmap_every)

    def _output(self, name: str, fn: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        """One output's work: an error stops that output (one warning), not the others."""
        if name in self._broken:
            return
        try:
            fn(*args, **kwargs)
        except Exception as e:
            if self.strict:
                raise
            self._broken.add(name)
            log.warning(
                "StabilityMonitor: the %s output stopped after an error (the other outputs and "
                "the protection go on): %r",
                name,
                e,
            )

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
