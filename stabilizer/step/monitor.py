"""`RunMonitor`: the step, once, for every host — what it does at each moment of a training.

A host (`stabilizer.step.host.Host`) builds one `RunMonitor` per run (each fit starts clean) and
calls it at the moments of each batch, in order:

1. `begin` — a micro-batch starts: the protection notes it (the buffers' copy, the random state
   for a replay), the preflight runs at the first one, activations are sampled;
2. `loss` — a loss is about to be backpropagated (each micro-batch's, divided by the
   accumulation: their sum is the step's);
3. `before_step` — the gradients are ready, the optimizer is about to step: the step is measured
   (its numbers go to the host without waiting) and the guard then decides inside
   ``optimizer.step`` (a host without this moment is measured by the guard itself);
4. `end` — the batch's steps are done: the protection checks and counts, the steps are
   reported (engine, outputs, remedies);

and `finish` at the end of training (the last report, the last check of the weights, the end
line), `abort` when the training died, `release` always. The monitor's own forwards (a
root-cause replay, the preflight) run `quiet`: the moments above ignore them.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from stabilizer.core.detectors import default_detectors
from stabilizer.core.detectors.base import Detector
from stabilizer.core.engine import Engine
from stabilizer.core.isolated import Isolated
from stabilizer.core.records import Finding
from stabilizer.core.run import RunHeader
from stabilizer.live.preflight import preflight_switches
from stabilizer.outputs.notify import Notifier

from .auto import AutoRemedies
from .batch import Batch, InFlight
from .console import Console
from .cost import CostMeter
from .first_batch import Preflight
from .guard import StepGuard
from .host import Host
from .live_outputs import LiveOutputs, Sinks, run_header
from .measurement import Measurer, Probes
from .policies import Auto, Policy, Protect
from .protect import Protection
from .report import Reporter

__all__ = ["Options", "RunMonitor", "RunView"]

log = logging.getLogger("stabilizer")


@dataclass(frozen=True)
class Options:
    """What the monitor reports, and where, whatever its policy.

    Args:
        detectors: The detectors to run (default: all registered, with default settings).
        grouping: ``parameter name -> depth group``, to override the naming conventions.
        activation_every: Sample activation maxima every N steps (0: never).
        heatmap_every: Write the per-layer heatmap image every N steps (0: only at the end).
        jsonl: Path of the JSONL log; True: beside the host's logs (or a new
            ``stability_logs/version_<N>/`` under its root dir); False: none.
        strict: Raise on an internal error of the monitor instead of warning once (else an error
            in reporting stops the reports, never the protection; an unchecked step is skipped).
        preflight: At the first batch, check the configuration and run the causal self-check:
            True, False, or a dict that switches single checks off.
        notify: Send findings (rank 0) from a background thread, once per episode.
        cost_budget: The share of the step time the monitor may take; above it one warning.
    """

    detectors: Sequence[Detector] | None = None
    grouping: Callable[[str], str] | None = None
    activation_every: int = 50
    heatmap_every: int = 100
    jsonl: str | Path | bool = True
    strict: bool = False
    preflight: bool | Mapping[str, bool] = True
    notify: Notifier | None = None
    cost_budget: float | None = 0.03
    switches: Mapping[str, bool] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        wrong = [
            (self.activation_every < 0, "activation_every", ">= 0", self.activation_every),
            (self.heatmap_every < 0, "heatmap_every", ">= 0", self.heatmap_every),
            (
                self.cost_budget is not None and not self.cost_budget > 0,
                "cost_budget", "> 0 or None", self.cost_budget,
            ),
        ]  # fmt: skip
        for bad, name, what, value in wrong:
            if bad:
                raise ValueError(f"`{name}` must be {what}, got {value!r}")
        object.__setattr__(self, "switches", preflight_switches(self.preflight))


class RunMonitor:
    """One run's monitor: the moments of each batch, for any host (see the module).

    Args:
        host: The training loop.
        policy: `Observe`, `Protect` or `Auto`.
        options: What to report, and where.
        sinks: The host's own outputs (its loggers, a TensorBoard writer).
    """

    def __init__(
        self, host: Host, policy: Policy, options: Options, sinks: Sinks | None = None
    ) -> None:
        self.host, self.policy, self.options = host, policy, options
        self._header: RunHeader | None = None  # the run's facts, from the start
        self.sinks = sinks or Sinks()
        strict = options.strict
        self.cost = CostMeter(options.cost_budget)
        self.outputs = LiveOutputs(
            Console(policy.name), options.jsonl, copy.deepcopy(options.notify),
            options.heatmap_every, strict, self.cost.part,
        )  # fmt: skip
        self.auto = AutoRemedies(host, policy) if isinstance(policy, Auto) else None
        self.batch = Batch()
        self.protection: Protection | None = None
        if isinstance(policy, Protect):
            self.protection = Protection(
                host, self.batch, policy, measure=self._measure,
                lr_factor=lambda: self.auto.lr.factor if self.auto is not None else 1.0,
                stepping_past=lambda s: self.auto is not None and self.auto.skip.active(s),
                quiet=self.quiet, strict=strict, part=self.cost.part,
            )  # fmt: skip
        self.reporter = Reporter(
            host, self._new_engine, self.outputs, self.cost, self.auto, self.protection, strict
        )
        self.measurer = Measurer(strict)
        self.preflight = Preflight(options.switches, strict)
        self.inert = False  # the monitor's own replay or preflight is running
        self._extra: list[Finding] = []  # the preflight's findings, reported with the first step
        self._data: object | None = None  # the dataloader the last step drew from
        self._new_data = False  # the coming step draws from a new one

    def _new_engine(self) -> Engine:
        """A fresh engine, from the detectors as given (one per optimizer), told the run's
        facts once they are known (an fp32 run has no fp16 range to watch)."""
        given = self.options.detectors
        engine = Engine(copy.deepcopy(list(given)) if given is not None else default_detectors())
        if self._header is not None:
            engine.set_run(self._header)
        return engine

    # --- the properties a host shows -------------------------------------------------------

    @property
    def findings(self) -> list[Finding]:
        """Every finding so far (every rank), in order."""
        return self.reporter.findings

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped (by the guard, or by an fp16 grad scaler)."""
        return self.protection.skipped_steps if self.protection is not None else 0

    @property
    def guard(self) -> StepGuard | None:
        """The optimizers' guard (policies `Protect` and `Auto`)."""
        return self.protection.guard if self.protection is not None else None

    @property
    def probes(self) -> Probes | None:
        """The run's probes, from the start (None if they could not be built)."""
        return self.measurer.probes

    @property
    def root_causes(self) -> int:
        """Root-cause replays run."""
        return self.protection.root_causes if self.protection is not None else 0

    @property
    def engine(self) -> Engine:
        """The detection engine (of the first optimizer's steps)."""
        return self.reporter.engine

    # --- the moments of a training --------------------------------------------------------

    def start(self, earlier: Sequence[Finding] = ()) -> None:
        """The run starts (after a resume's state is loaded: `earlier` are its findings). An
        error leaves the run without probes: every step is unmeasured, and `Protect` skips
        them all, loudly."""
        host = self.host
        with Isolated(self.options.strict) as starting:
            if self.auto is not None:
                self.auto.start()
            acts = bool(self.options.activation_every)
            probes = Probes(host.module, host.optimizers, self.options.grouping, acts)
            self.measurer.probes = probes
        if starting.error is not None:
            log.error("stabilizer could not start: %r", starting.error, exc_info=starting.error)
        groups = self.probes.grads.groups if self.probes is not None else None
        self._header = run_header(host.facts, self.policy.name, groups or ())
        for engine in self.reporter.engines:
            self.reporter.safely(engine.set_run, self._header)
        self.reporter.safely(
            self.outputs.open, host.facts, host.module, groups, self.options.grouping,
            list(earlier) or self.findings, self.policy.name, self.sinks,
        )  # fmt: skip

    def begin(self, batch: Any, index: int) -> None:
        """A micro-batch starts (before its forward)."""
        prot = self.protection
        if self.inert or (
            prot is not None and prot.guard.evaluating is not None and self.batch.micro
        ):
            return  # (an evaluating optimizer's closure, run again inside its step)
        self.cost.batch_start(self.host.step)
        data = self.host.data
        if data is not None and data is not self._data:
            self._new_data, self._data = self._data is not None, data
        with self.cost.part("measure"):
            if self.protection is not None:
                self.protection.begin(batch, index)
            else:
                self.batch.begin(batch, index, None)  # the micro-batches' losses, nothing kept
            self._extra += self.preflight(self.host, batch, self.quiet, self.guard)
            if self.probes is not None:
                self.probes.sample(self.host.step, self.options.activation_every)

    def loss(self, loss: torch.Tensor) -> None:
        """A backward is about to run on `loss` (divided by the accumulation, under it); an
        evaluating optimizer's later evaluations are no loss of the step."""
        prot = self.protection
        if not self.inert and not (prot is not None and prot.evaluating()):
            with self.cost.part("measure"):
                self.batch.add_loss(loss)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The gradients are ready and `optimizer` is about to step: measure it (the guard then
        decides inside the step); report the last step meanwhile (the device works)."""
        prot = self.protection
        if self.inert or (prot is not None and prot.evaluating_again(optimizer)):
            return
        self._measure(optimizer)
        self.reporter.pending()  # the last step's, while the device works

    def _measure(self, optimizer: torch.optim.Optimizer) -> InFlight:
        """Measure `optimizer`'s coming step and put it in flight (the guard's own, for a host
        without a moment before the step)."""
        prot = self.protection
        with self.cost.part("measure"):  # the numbers go to the host without waiting
            loss = self.batch.step_loss()
            weights = prot.weights.check if prot is not None else None
            factor = self.auto.lr.factor if self.auto is not None else 1.0
            measured = self.measurer(self.host, optimizer, loss, weights, factor)
        step = InFlight(measured, found=self._extra, new_data=self._new_data)
        self._extra, self._new_data = [], False
        self.batch.add(optimizer, step)
        if prot is not None:
            with self.cost.part("guard"):
                prot.measured(optimizer, step)  # (an optimizer not guarded yet is judged here)
        return step

    def end(self) -> None:
        """The batch's steps are done: check, count, report."""
        if self.inert:
            return
        if self.probes is not None:
            self.cost.add("activations", self.probes.take_seconds())
        steps = self.batch.end()
        if steps and self.protection is not None:
            with self.cost.part("guard"):
                self.protection.end(steps)
        self.reporter.steps(steps)
        self.cost.batch_end(self.host.step)

    def finish(self) -> None:
        """The last step's report, the last check of the weights, the run's end."""
        reporter, prot = self.reporter, self.protection
        reporter.pending()
        if prot is not None:
            found = prot.finish()
            if found:
                reporter.safely(reporter.emit, None, found)
        skipped = prot.skipped_steps if prot is not None else 0
        reporter.safely(reporter.finish, skipped, prot.intact if prot else None)

    def abort(self) -> None:
        """The training died (or was interrupted): keep what was measured; every line written
        is flushed."""
        with contextlib.suppress(Exception):
            self.reporter.pending()
        self.outputs.abort()

    def release(self) -> None:
        """The run is over: the optimizers unguarded, the remedies' hooks removed."""
        if self.protection is not None:
            self.protection.guard.uninstall()
        if self.auto is not None:
            self.auto.stop()

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """The monitor's own forwards (replay, preflight): the moments ignore them."""
        self.inert = True
        try:
            yield
        finally:
            self.inert = False

    # --- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (every step up to it reported first)."""
        self.reporter.pending()
        return self.reporter.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Back to a checkpoint's `state_dict` (a resumed run was checked when it started)."""
        self.reporter.load_state_dict(state)
        self.preflight.done = True


class RunView:
    """What a host's front end (the Lightning callback, a loop's `Stabilizer`, the HF callback)
    shows of its `run`: nothing before the run starts, the last run's after it."""

    run: RunMonitor | None

    @property
    def findings(self) -> list[Finding]:
        """Every finding of the run so far (every rank), in order."""
        return self.run.findings if self.run is not None else []

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped (by the guard, or by an fp16 grad scaler)."""
        return self.run.skipped_steps if self.run is not None else 0

    @property
    def guard(self) -> StepGuard | None:
        """The optimizers' guard (`Protect` and `Auto`)."""
        return self.run.guard if self.run is not None else None

    @property
    def probes(self) -> Probes | None:
        """The run's probes (None before the run, or if they could not be built)."""
        return self.run.probes if self.run is not None else None

    @property
    def root_causes(self) -> int:
        """Root-cause replays run."""
        return self.run.root_causes if self.run is not None else 0
