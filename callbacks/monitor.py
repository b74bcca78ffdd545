"""``StabilityMonitor``: the live feed. Probes each optimizer step, runs the engine, reports.

The monitor wires Lightning's hooks to its parts, each in a module of its own: measuring a step
(`measure`), the protection and its guard inside the optimizer step (`protection`, `guard`),
the outputs (`outputs`), the one-off checks (`checks`), the remedies (`auto`) and its own cost
(`cost`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from stabilizer.core.detectors import default_detectors
from stabilizer.core.detectors.base import Detector
from stabilizer.core.engine import Engine
from stabilizer.core.records import Finding
from stabilizer.live.preflight import preflight_switches
from stabilizer.outputs.notify import Notifier

from .auto import AutoRemedies
from .checks import preflight
from .console import Console
from .cost import CostMeter
from .guard import StepGuard
from .live_step import LiveStep
from .measure import Measured, Probes
from .outputs import LiveOutputs
from .protection import Protection
from .reporting import Reporter

__all__ = ["StabilityMonitor"]

log = logging.getLogger("stabilizer")

_POLICIES = ("protect", "observe", "auto")


class StabilityMonitor(pl.Callback):
    """Catch loss spikes, divergence, NaN/Inf, fp16 overflow and starved layers as they happen.

    Each optimizer step the monitor measures its signals on the device, copies them to the host
    once, and feeds them as a :class:`~stabilizer.core.records.StepRecord` to the detection
    :class:`~stabilizer.core.engine.Engine` (the one ``stabilizer diagnose`` replays logs with).
    Records and findings go to the console (rank 0), every logger of the Trainer (under
    ``stability/``: the keys are listed in the README), ``stability.jsonl`` beside the logs,
    TensorBoard's extras (a layout, a layers × steps heatmap, the findings table) and
    notifications.

    Policies (``docs/protection.md``): ``"protect"`` (default) decides inside each optimizer
    step, after every hook and the clipping, and skips a step whose loss, gradients or LR are
    non-finite; copies and checks a step whose arithmetic can overflow; checks what the steps
    let through; stops after ``stop_after`` bad steps in a row, or at once when the weights are
    found non-finite. ``"observe"`` only detects and reports. ``"auto"`` protects and applies
    the remedies of :class:`~stabilizer.callbacks.auto.AutoRemedies`.

    On a GPU the step never waits for Python: ``protect`` waits for the step's one copy only
    to decide whether to skip; the rest of a step's work runs during the next step's backward.

    Args:
        policy: ``"protect"``, ``"observe"`` or ``"auto"``.
        detectors: The detectors to run (default: all registered, with default settings).
        grouping: ``parameter name -> depth group``, to override the naming conventions.
        activation_every: Sample activation maxima every N steps (0: never).
        heatmap_every: Write the per-layer heatmap image every N steps (0: only at the end).
        jsonl: Path of the JSONL log; default ``<trainer.log_dir>/stability.jsonl``, or without
            a logger ``<default_root_dir>/stability_logs/version_<N>/stability.jsonl``, a new
            version each run (a resumed run appends to its own); ``False`` for none.
        strict: Raise on an internal error of the monitor instead of warning once (training goes
            on either way when ``False``: an error in reporting stops the reports, never the
            protection; a step the guard cannot check is skipped).
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
        self.activation_every, self.heatmap_every, self.jsonl = (
            activation_every, heatmap_every, jsonl,
        )  # fmt: skip
        self.stop_after, self.root_cause = stop_after, root_cause
        self.preflight = preflight_switches(preflight)
        self.cost = CostMeter(cost_budget)
        self.outputs = LiveOutputs(
            Console(policy), jsonl, notify, heatmap_every, strict, self.cost.part
        )
        self.auto = (auto or AutoRemedies()) if policy == "auto" else None
        self.live = LiveStep(keep_batches=False)  # the batch in flight
        self.protection = None if policy == "observe" else Protection(
            self.live, verify=guard_optimizer, stop_after=stop_after, root_cause=root_cause,
            max_root_causes=self.MAX_ROOT_CAUSES,
            lr_factor=lambda: self.auto.lr.factor if self.auto is not None else 1.0,
            stepping_past=lambda s: self.auto is not None and self.auto.skip.active(s),
            inert=self._sandboxed, strict=strict, part=self.cost.part,
        )  # fmt: skip
        self.engine = Engine(list(detectors) if detectors is not None else default_detectors())
        self.reporter = Reporter(
            self.engine, self.outputs, self.cost, self.auto, self.protection, strict
        )
        self.probes: Probes | None = None
        self._extra: list[Finding] = []  # preflight findings, reported with the first step
        self._preflight_done = False
        self._inert = False  # the monitor's own replay or preflight is running: hooks ignore it
        self._fit: tuple[pl.Trainer, pl.LightningModule] | None = None
        self._warned = False

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
    def findings(self) -> list[Finding]:
        """Every finding so far (every rank), in order."""
        return self.reporter.findings

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
        groups = self.probes.grads.groups if self.probes is not None else None
        self.reporter.safely(
            self.outputs.open, trainer, pl_module, groups, self.grouping, self.findings,
            self.policy,
        )  # fmt: skip

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.cost.batch_start(trainer.global_step)
        with self.cost.part("measure"):
            if self.protection is not None:
                self.protection.begin_batch(trainer, batch, batch_idx)
            else:
                self.live.begin(batch, batch_idx, None)  # the micro-batches' losses, nothing kept
            if any(self.preflight.values()) and not self._preflight_done:
                self._preflight_done = True
                guard, on = self.guard, self.preflight
                self._extra += preflight(
                    trainer, pl_module, batch, on, self._sandboxed, guard, self.strict
                )
            acts, every = self.probes.acts if self.probes else None, self.activation_every
            if acts is not None and every and trainer.global_step % every == 0:
                acts.attach()

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        # Under gradient accumulation Lightning hands over loss / accumulate_grad_batches for each
        # micro-batch: their sum is the step's mean loss.
        if not self._inert:
            with self.cost.part("measure"):
                self.live.add_loss(loss)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        prot = self.protection
        if self._inert or (prot is not None and prot.evaluating_again(optimizer)):
            return
        with self.cost.part("measure"):
            step = self._measure(trainer, optimizer)  # the numbers are on their way to the host
        self.reporter.pending(trainer, pl_module)  # the last step's, while the device works
        # As the step will use it: after the remedies so far.
        factor = self.auto.lr.factor if self.auto is not None else 1.0
        step.note(trainer, optimizer, factor, self.protection is not None)
        step.found, self._extra = self._extra, []
        self.live.add(optimizer, step)
        if prot is not None:
            with self.cost.part("guard"):
                prot.measured(optimizer, step)  # the guard decides inside the step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        acts = self.probes.acts if self.probes is not None else None
        if acts is not None:
            self.cost.add("activations", acts.seconds)
            acts.seconds = 0.0
        steps = self.live.end()
        if steps and self.protection is not None:
            with self.cost.part("guard"):
                self.protection.end_batch(trainer, steps)
        self.reporter.steps(trainer, pl_module, steps)
        self.cost.batch_end(trainer.global_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        reporter = self.reporter
        reporter.pending(trainer, pl_module)
        if self.protection is not None:
            found = self.protection.finish(trainer, pl_module)
            if found:
                reporter.safely(reporter.emit, trainer, None, found)
        intact = self.protection.intact if self.protection is not None else None
        reporter.safely(reporter.finish, trainer, self.skipped_steps, intact)

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
        if self.protection is not None:
            self.protection.guard.uninstall()
        if self.auto is not None:
            self.auto.stop()

    def state_dict(self) -> dict[str, Any]:
        if self._fit is not None:  # a checkpoint holds every step up to it, as on the CPU
            self.reporter.pending(*self._fit)
        path = self.outputs.default_path
        state: dict[str, Any] = {
            "engine": self.engine.state_dict(),
            "findings": [f.to_dict() for f in self.findings],
            "auto": self.auto.state_dict() if self.auto is not None else None,
            "jsonl": str(path) if path is not None else None,
        }
        return state | (self.protection.state_dict() if self.protection is not None else {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.engine.load_state_dict(state_dict["engine"])
        self.reporter.findings = [Finding.from_dict(f) for f in state_dict["findings"]]
        self._preflight_done = True  # a resumed run was checked when it started
        if self.auto is not None and state_dict.get("auto"):
            self.auto.load_state_dict(state_dict["auto"])
        if self.protection is not None:
            self.protection.load_state_dict(state_dict)
        jsonl = state_dict.get("jsonl")
        self.outputs.default_path = Path(jsonl) if jsonl else None

    # --- measuring: at the step itself ----------------------------------------------------------

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            if self.protection is not None:
                self.protection.start(trainer, pl_module, self)
            if self.auto is not None:
                self.auto.start(trainer, pl_module)
            acts = bool(self.activation_every)
            self.probes = Probes(pl_module, trainer.optimizers, self.grouping, acts)
        except Exception as e:
            if self.strict:
                raise
            # Without probes every step is unmeasured: `protect` skips them all, loudly.
            log.error("StabilityMonitor could not start: %r", e, exc_info=True)

    def _measure(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> Measured:
        loss, prot = self.live.step_loss(), self.protection
        try:
            if self.probes is None:
                raise RuntimeError("the gradient probe could not be built at fit start")
            buffers = prot.buffers_nonfinite if prot is not None else None
            return self.probes.measure(trainer, optimizer, loss, buffers, prot is not None)
        except Exception as e:
            if self.strict:
                raise
            if not self._warned:
                self._warned = True
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


def _check_arguments(
    policy: str, activation_every: int, heatmap_every: int, stop_after: int | None,
    cost_budget: float | None,
) -> None:  # fmt: skip
    if policy not in _POLICIES:
        raise ValueError(f"`policy` must be one of {', '.join(_POLICIES)}, got {policy!r}")
    for name, value in (("activation_every", activation_every), ("heatmap_every", heatmap_every)):
        if value < 0:
            raise ValueError(f"`{name}` must be >= 0, got {value}")
    if stop_after is not None and stop_after < 1:
        raise ValueError(f"`stop_after` must be >= 1 or None, got {stop_after}")
    if cost_budget is not None and not cost_budget > 0:
        raise ValueError(f"`cost_budget` must be > 0 or None, got {cost_budget}")
