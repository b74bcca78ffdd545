"""`RunMonitor`: one run of the step, for every host — what it does at each moment of a training.

A host (`stabilizer.step.host.Host`) builds one `RunMonitor` per run and calls it at the
moments of each block (`stabilizer.step.step`: a batch, an accumulation window, a loop's
``with stab.step()``), in order:

1. `begin` — a micro-batch starts: the policy's runtime notes it (the buffers' copy, the random
   state for a replay), the preflight runs at the first one, activations are sampled;
2. `loss` — a loss is about to be backpropagated (each micro-batch's share of the step's);
3. `before_step` — the gradients are ready, an optimizer is about to step: its step is measured
   (a host without this moment is measured inside ``optimizer.step``, by the guard);
4. inside ``optimizer.step`` the guard asks `judge` and tells `ran` (`stabilizer.step.guard`);
5. `end` — the block is over: its steps end (`stabilizer.step.step.InFlight.end`), are checked
   and counted by the policy's runtime, and reported; the answer ``should_stop`` is what the
   host acts on;

and `finish` at the end of training (the last report, the last check of the weights, the end
line), `abort` when the training died, `release` always. The monitor's own forwards (a
root-cause replay, the preflight) run `quiet`: the moments above ignore them and no optimizer
steps. What a policy does beyond reporting is its runtime (`RUNTIMES`); a resumed run is the
run it resumes (`state_dict`, `resumed=`), under every host.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from stabilizer.core.detectors import default_detectors
from stabilizer.core.engine import Engine
from stabilizer.core.isolated import Isolated
from stabilizer.core.records import Finding
from stabilizer.core.run import RunHeader

from .auto import AutoRemedies
from .console import STOP_LINE, Console
from .cost import CostMeter, over_budget_advice
from .first_batch import Preflight
from .guard import OVERFLOW, Decision, StepGuard
from .host import Host
from .live_outputs import LiveOutputs, Sinks, run_header
from .measurement import Measurer, Probes, Setting
from .options import Options
from .policies import Auto, Observe, Policy, Protect
from .protect import Protection, Remedies, Watching
from .ranks import Ranks
from .report import Reporter
from .step import InFlight, OptimizerStep, Stage, parameters

__all__ = ["RUNTIMES", "RunMonitor"]

log = logging.getLogger("stabilizer")

RUNTIMES: dict[type[Observe] | type[Protect], tuple[type[Watching], type[Remedies]]] = {
    Observe: (Watching, Remedies),
    Protect: (Protection, Remedies),
    Auto: (Protection, AutoRemedies),
}
"""Policy -> what runs for it: the step's runtime (`Watching` lets every step through;
`Protection` skips, checks, counts) and its remedies (`Remedies` applies none)."""

_OUTCOMES = ("stepped", "skipped", "reverted")


class RunMonitor:
    """One run's monitor: the moments of each block, for any host (see the module).

    Args:
        host: The training loop.
        policy: `Observe`, `Protect` or `Auto`.
        options: What to report, and where.
        sinks: The host's own outputs (its loggers, a TensorBoard writer).
        resumed: The `state_dict` of the run this one resumes (a checkpoint's), or None.
    """

    def __init__(
        self,
        host: Host,
        policy: Policy,
        options: Options,
        sinks: Sinks | None = None,
        resumed: Mapping[str, Any] | None = None,
    ) -> None:
        self.host, self.policy, self.options = host, policy, options
        self.sinks, self._resumed = sinks or Sinks(), dict(resumed) if resumed else None
        self._header: RunHeader | None = None  # the run's facts, from the start
        facts = host.facts
        self.ranks = Ranks(facts.world_size, facts.rank)
        self.cost = CostMeter(options.cost_budget)
        jsonl = options.jsonl
        if self._resumed is not None and self._resumed.get("jsonl") and jsonl is True:
            jsonl = str(self._resumed["jsonl"])  # the default JSONL of the run it resumes
        self.outputs = LiveOutputs(
            Console(policy.name), jsonl, copy.deepcopy(options.notify), options.heatmap_every,
            options.strict, self.cost.part,
        )  # fmt: skip
        self.block = InFlight()
        self.block.params = lambda: parameters(host.optimizers)
        runtime, remedies = RUNTIMES[type(policy)]
        self.runtime = runtime(host, self.block, policy, self.ranks, self.quiet, options.strict)
        self.remedies = remedies(host, policy)
        self.guard = StepGuard(self, protects=self.runtime.protects)
        self.guard.cover(host.optimizers)
        self.reporter = Reporter(
            host, self._new_engine, self.outputs, self.cost, self.remedies, options.strict,
            on_restart=self.runtime.restart,
        )  # fmt: skip
        self.measurer = Measurer(options.strict)
        self.preflight = Preflight(options.switches, options.strict)
        self.inert = False  # the monitor's own replay or preflight is running
        self.skipped_steps = 0  # optimizer steps whose update did not happen
        self.should_stop = False  # the step's answer, which the host acts on
        self.stopped = ""  # why it stopped the run (its stop line's reason), once it did
        self._extra: list[Finding] = []  # the preflight's findings, reported with the first step
        self._data: object | None = None  # the dataloader the last step drew from
        self._new_data = False  # the coming step draws from a new one
        self._abandoned = 0  # blocks that ended without their optimizer stepping

    def _new_engine(self) -> Engine:
        """A fresh engine, from the detectors as given (one per optimizer), told the run's
        facts once they are known (an fp32 run has no fp16 range to watch)."""
        given = self.options.detectors
        engine = Engine(copy.deepcopy(list(given)) if given is not None else default_detectors())
        if self._header is not None:
            engine.set_run(self._header)
        return engine

    # --- what a host's front end shows ---------------------------------------------------------

    @property
    def findings(self) -> list[Finding]:
        """Every finding so far (every rank), in order."""
        return self.reporter.findings

    @property
    def probes(self) -> Probes | None:
        """The run's probes, from the start (None if they could not be built)."""
        return self.measurer.probes

    @property
    def root_causes(self) -> int:
        """Root-cause replays run."""
        return self.runtime.root_causes

    @property
    def applied(self) -> Mapping[str, int]:
        """The remedies applied so far (``auto``), and how often."""
        return self.remedies.applied

    # --- the moments of a training ------------------------------------------------------------

    def start(self) -> None:
        """The run starts (after its state is loaded, when it resumes one). An error leaves it
        without probes: every step is unmeasured, and `Protect` skips them all, loudly."""
        host, resumed = self.host, self._resumed
        if resumed is not None:
            self._load(resumed)
        with Isolated(self.options.strict) as starting:
            self.remedies.start(resumed is not None)
            acts = bool(self.options.activation_every)
            self.measurer.probes = Probes(host.module, host.optimizers, self.options.grouping, acts)
        if starting.error is not None:
            log.error("stabilizer could not start: %r", starting.error, exc_info=starting.error)
        groups = self.probes.grads.groups if self.probes is not None else None
        self._header = run_header(host.facts, self.policy.name, groups or ())
        for engine in self.reporter.engines:
            self.reporter.safely(engine.set_run, self._header)
        self.reporter.safely(
            self.outputs.open, host.facts, host.module, groups, self.options.grouping,
            self.findings, self.policy.name, self.sinks,
        )  # fmt: skip

    def begin(self, batch: Any, index: int) -> None:
        """A micro-batch starts (before its forward)."""
        if self.inert or (self.guard.evaluating is not None and self.block.micro):
            return  # (an evaluating optimizer's closure, run again inside its step)
        host = self.host
        step = host.step
        self.cost.batch_start(step)
        data = host.data
        if data is not None and data is not self._data:
            self._new_data, self._data = self._data is not None, data
        with self.cost.part("measure"):
            optimizers = host.optimizers
            self.guard.cover(optimizers)  # (one created or replaced since)
            if not self.block.micro:  # the block's first: before its forward
                self._extra += self.runtime.begin(step, optimizers)
            self.block.begin(batch, index, optimizers)
            if not self.preflight.done:
                self._extra += self.preflight(host, batch, self.quiet)
            if self.probes is not None:
                self.probes.sample(step, self.options.activation_every)

    def loss(self, loss: torch.Tensor) -> None:
        """A backward is about to run on `loss` (divided by the accumulation, under it); an
        evaluating optimizer's later evaluations are no loss of the step."""
        if not self.inert and not self._evaluating():
            self.block.add_loss(loss)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The gradients are ready and `optimizer` is about to step: measure it, unless it is
        measured already (the guard then decides inside the step); report the last step
        meanwhile (the device works)."""
        if self.inert or (self.guard.evaluating is optimizer and self._evaluating()):
            return
        step = self.block.of(optimizer)
        if step is not None and step.stage is Stage.DECIDED:
            return  # (inside its guarded step: an optimizer that unscales its gradients itself)
        if step is None or not step.open:
            self._measure(optimizer, before=True)
        if not self.guard.covers(optimizer):
            self._judge_unguarded(optimizer)
        self._act(*self.reporter.pending(), self.reporter.last)  # the last step's, meanwhile

    def _judge_unguarded(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer created inside this block (its step under way, unguarded): guarded
        from its next step; this one is judged here, the latest point left, and a skip drops
        its gradients (torch optimizers pass over parameters without one)."""
        self.guard.cover([optimizer])
        skip = self.judge(optimizer).skip
        if skip:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
        self.ran(optimizer, "skipped" if skip else "stepped")

    def _measure(self, optimizer: torch.optim.Optimizer, before: bool) -> OptimizerStep:
        """Open `optimizer`'s step and measure it (the numbers go to the host without
        waiting)."""
        host, block = self.host, self.block
        optimizers = host.optimizers
        index = next((i for i, opt in enumerate(optimizers) if opt is optimizer), 0)
        with self.cost.part("measure"):
            at = host.step
            step = block.open(
                optimizer, at, index, new_data=self._new_data, guarded=self.runtime.protects
            )
            step.found += self._extra
            self._extra, self._new_data = [], False
            setting = Setting(
                at, host.scaler, host.clip, self.ranks, host.facts.sharded,
                self.remedies.lr_factor, len(optimizers) <= 1,
            )  # fmt: skip
            step.measure(self.measurer(optimizer, step.loss, self.runtime.check, setting), before)
        self.runtime.measured(step)
        return step

    # --- inside optimizer.step: the guard's questions (`stabilizer.step.guard.Judge`) ----------

    def judge(self, optimizer: torch.optim.Optimizer) -> Decision:
        """Decide `optimizer`'s step, measured now if no moment before did."""
        step = self.block.of(optimizer)
        if step is None or not step.open:
            step = self._measure(optimizer, before=False)
        with self.cost.part("guard"):
            stepping_past = self.remedies.stepping_past(step.step)
            decision = self.runtime.decide(step, optimizer, stepping_past)
            step.decide(decision)
        return decision

    def ran(self, optimizer: torch.optim.Optimizer, outcome: str) -> None:
        """What became of the step the guard decided."""
        step = self.block.of(optimizer)
        assert step is not None and outcome in _OUTCOMES  # (decided by `judge` first)
        if outcome == "stepped":
            step.stepped()
        elif outcome == "reverted":
            step.revert()
        else:
            step.skip("scaler" if step.reason == OVERFLOW else "guard")
            with self.cost.part("guard"):
                self.runtime.skipped(step)

    def first_evaluation(self, optimizer: torch.optim.Optimizer) -> None:
        """An evaluating optimizer's first closure evaluation: its step, as it started, is
        measured here unless a moment before measured it."""
        if self.block.current(optimizer) is None:
            self._measure(optimizer, before=False)

    def _evaluating(self) -> bool:
        """An evaluating optimizer's step is under way and measured: what its closure does now
        (another forward, another loss) is no new micro-batch or loss of the step."""
        opt = self.guard.evaluating
        return opt is not None and self.block.current(opt) is not None

    # --- the end of a block -------------------------------------------------------------------

    def end(self, carry: bool = False) -> int:
        """The block is over (`carry`: a block that stepped nothing holds micro-batches of the
        next, as Lightning's automatic accumulation does). Its steps end, are checked, counted
        and reported. Returns how many step numbers its optimizer steps took (run, skipped or
        undone; 0: none; 2 where an optimizer stepped twice in a host's step that does not
        advance between them); `should_stop` holds the answer for the host."""
        if self.inert:
            return False
        if self.probes is not None and self.probes.sampled:  # (only then are hooks timed)
            self.cost.add("activations", self.probes.take_seconds())
        at = self.host.step
        steps = self.block.end(at, carry)
        taken = [step for step in steps if step.ended is not Stage.ABANDONED]
        for step in steps:
            if step not in taken:
                self._abandon(step)
        self.skipped_steps += sum(step.skipped for step in taken)
        with self.cost.part("guard"):
            self._act(*self.runtime.end(taken), taken[-1] if taken else None)
        self._act(*self.reporter.steps(taken), self.reporter.last)
        over = self.cost.batch_end(at)
        if over is not None and self.host.facts.is_global_zero:
            log.warning("stabilizer: %s, %s", over.describe(), over_budget_advice(over))
        return len({step.step for step in taken})

    def _abandon(self, step: OptimizerStep) -> None:
        """A block that ended without its optimizer stepping: said (the first at INFO), and
        let go; nothing of it carries into the next step."""
        self._abandoned += 1
        level = logging.INFO if self._abandoned == 1 else logging.DEBUG
        if self.host.facts.is_global_zero:
            log.log(
                level,
                "stabilizer: step %d: a backward no optimizer step took (its gradients zeroed "
                "first, or its step never ran): abandoned (its loss and micro-batches are not "
                "carried into the next step; said once)",
                step.step,
            )
        step.report()

    def _act(self, stop: bool, why: str, step: OptimizerStep | None) -> None:
        """The one place a stop is acted on: the stop line (saying what was checked of the
        weights before `step`, the one that answered stop), and `should_stop` for the host."""
        if not stop or self.should_stop:
            return
        self.should_stop, self.stopped = True, why
        path = self.host.checkpoint
        where = f"; last checkpoint: {path}" if path else "; no checkpoint was saved"
        where = where if path is not None else ""  # the host cannot tell
        if step is not None and not step.weights_bad and step.checked:
            state = f"weights checked finite before step {step.step}"
            state += ", its update skipped" if step.skipped else ""
        else:
            state = "the weights are NOT intact"
        if self.host.facts.is_global_zero:
            at = step.step if step is not None else self.host.step
            log.error(STOP_LINE + "%d: %s (%s)%s", at, why, state, where)

    def finish(self) -> None:
        """The last step's report, the last check of the weights, the run's end."""
        reporter = self.reporter
        self._act(*reporter.pending(), reporter.last)
        found = self.runtime.finish()
        if found:
            reporter.safely(reporter.emit, None, found)
        reporter.safely(reporter.finish, self.skipped_steps, self.runtime.intact, self.stopped)

    def abort(self) -> None:
        """The training died (or was interrupted): keep what was measured; every line written
        is flushed."""
        with contextlib.suppress(Exception):
            self.reporter.pending()
        self.outputs.abort()

    def release(self) -> None:
        """The run is over: the optimizers unguarded, the remedies' hooks removed."""
        self.guard.uninstall()
        self.remedies.stop()

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """The monitor's own forwards (replay, preflight): the moments ignore them, and no
        optimizer steps inside."""
        self.inert = True
        try:
            with self.guard.inert():
                yield
        finally:
            self.inert = False

    # --- resume: the same on every host ---------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (every step up to it reported first): the engines, the
        findings, the counters, the remedies in force, the JSONL it writes, the host's step."""
        self._act(*self.reporter.pending(), self.reporter.last)
        path = self.outputs.default_path or self.outputs.path
        return self.reporter.state_dict() | self.runtime.state_dict() | {
            "skipped_steps": self.skipped_steps, "step": self.host.step,
            "jsonl": str(path) if path is not None else None,
        }  # fmt: skip

    def _load(self, state: Mapping[str, Any]) -> None:
        """Back to a checkpoint's `state_dict` (a resumed run was checked when it started)."""
        self.reporter.load_state_dict(dict(state))
        self.runtime.load_state_dict(dict(state))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.preflight.done = True
