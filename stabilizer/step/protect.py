"""``Protection``: the rules of policies `Protect` and `Auto`, each with one home.

- The guard (`StepGuard`) calls the judge inside every optimizer step, after every hook and the
  clipping: the decision (`decide`) is taken on the gradients and the LR as the step will use
  them. The measurement is reused when nothing can have touched the gradients since (the host
  runs no user code after it, their tensors and torch's version counters are unchanged, or only
  the host's own clipping of finite gradients ran); otherwise the gradients are counted again,
  once. A host without a hook before the step (a plain loop) is measured by the judge itself.
- Every measurement also checks the weights (`stabilizer.step.weights.WeightsWatch`): a step
  that finds a value turned non-finite is skipped and reported as critical: the weights are not
  intact, and the run stops (`Auto` rolls back instead).
- A skipped step's buffers are put back; the first bad step of an episode is replayed to name
  its cause (`root_cause`), with no optimizer able to step inside.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from stabilizer.core.records import Finding, Severity
from stabilizer.core.signals import GRAD_NORM, NONFINITE_GRADS
from stabilizer.live.rng import RngState
from stabilizer.live.tensors import count_nonfinite

from .batch import Batch, InFlight
from .guard import BAD_LR, BAD_WEIGHTS, UNCHECKED, Decision, StepGuard, decide, risky_arithmetic
from .host import Host
from .policies import Protect
from .replay import root_cause
from .weights import WeightsWatch

__all__ = ["Protection"]

log = logging.getLogger("stabilizer")

Measure = Callable[[torch.optim.Optimizer], InFlight]


class Protection:
    """The guard, its judge, the weights' check, the counting and the stop of a protected run.

    Args:
        host: The training loop.
        batch: The batch in flight (shared with the monitor).
        policy: The policy's knobs (`Protect` or `Auto`).
        measure: Measures an optimizer's coming step now (the judge's, where the host has no
            hook before the step).
        lr_factor: The LR multiplier in force (`Auto`), read at each step.
        stepping_past: Whether `Auto` is stepping past bad data at a step.
        quiet: The monitor's context in which its own hooks ignore what runs (a replay).
        strict: Raise on an internal error instead of warning.
        part: The cost meter's ``part``.
    """

    def __init__(
        self,
        host: Host,
        batch: Batch,
        policy: Protect,
        *,
        measure: Measure,
        lr_factor: Callable[[], float],
        stepping_past: Callable[[int], bool],
        quiet: Callable[[], AbstractContextManager[None]],
        strict: bool,
        part: Callable[[str], AbstractContextManager[None]] | None = None,
    ) -> None:
        self.host, self.batch, self.policy, self.strict = host, batch, policy, strict
        self._measure, self._lr_factor, self._stepping_past = measure, lr_factor, stepping_past
        self._quiet = quiet
        self._part = part or (lambda name: nullcontext())
        self.guard = StepGuard(self._timed_judge, self._reverted, self._first_evaluation)
        self.weights = WeightsWatch(host.module)
        self.bad_runs: dict[int, int] = {}  # optimizer index -> its consecutive bad steps
        self.skipped_steps = 0  # optimizer steps skipped, by the guard or by a grad scaler
        self.root_causes = 0
        self.intact: bool | None = None  # the last check of the weights: None before any
        self._reported_bad_weights = False
        self._notes: list[Finding] = []  # tensors holding NaN/Inf by design: said with a step
        self.guard.cover(host.optimizers)

    def state_dict(self) -> dict[str, Any]:
        """The counters a checkpoint keeps (in the monitor's state)."""
        return {
            "bad_in_a_row": self.bad_in_a_row, "bad_runs": dict(self.bad_runs),
            "skipped_steps": self.skipped_steps, "root_causes": self.root_causes,
            "skipped": self.guard.skipped, "reverted": self.guard.reverted,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        runs = state.get("bad_runs") or {0: state.get("bad_in_a_row", 0)}
        self.bad_runs = {int(k): int(v) for k, v in runs.items()}
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.root_causes = int(state.get("root_causes", 0))
        self.guard.skipped = int(state.get("skipped", 0))
        self.guard.reverted = int(state.get("reverted", 0))

    # --- batch boundaries ------------------------------------------------------------------

    def begin(self, batch: object, index: int) -> None:
        """A micro-batch starts: guard any optimizer created or replaced since; at a step's
        first, copy the buffers and learn what is new (before the forward)."""
        host = self.host
        self.guard.cover(host.optimizers)
        self.batch.keep_batches = (
            self.policy.root_cause and self.root_causes < self.policy.max_root_causes
        )
        rng = RngState.capture() if self.batch.keep_batches else None
        if self.batch.begin(batch, index, rng):
            self._notes += self.weights.begin(host.optimizers, host.step)

    def evaluating_again(self, optimizer: torch.optim.Optimizer) -> bool:
        """A closure evaluated again inside one step (LBFGS): that step was measured once; the
        evaluation's loss is dropped."""
        step = self.batch.current(optimizer)
        if self.guard.evaluating is not optimizer or step is None or step.decision is not None:
            return False
        self.batch.step_loss()
        return True

    def measured(self, optimizer: torch.optim.Optimizer, step: InFlight) -> None:
        """A step was measured before it ran. An optimizer that is not guarded yet (replaced
        inside this batch) is guarded from its next step on; this one is judged here, the latest
        point left, and a skip drops its gradients (torch optimizers pass over parameters
        without one)."""
        buffers = self.weights.buffers_nonfinite
        step.guarded = True
        step.recount = lambda: self.weights.count(optimizer, buffers)
        step.found += self._notes  # tensors found holding NaN/Inf by design: said once
        self._notes = []
        if step.measurement.scaled and step.bad:
            # Under a grad scaler a NaN loss makes NaN gradients: the scaler, not the guard,
            # skips the step, so the replay runs here, before it (this reads the numbers now).
            self._replay(step)
        if self.guard.covers(optimizer):
            return
        self.guard.cover([optimizer])
        if self._judge(optimizer).skip:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None

    def end(self, steps: Sequence[InFlight]) -> None:
        """After the batch's steps: buffers back if one was skipped (a scaler's skip), the
        weights' check, the monitor's own findings of a first bad step, counting and stop."""
        self.weights.buffers.end(restore=any(s.skipped for s in steps))
        for step in steps:
            if step.skipped and step.measurement.numbers is not None:
                step.check_all()  # after any restore: what "weights intact" beside it says
            self._weights_checked(step)
            if step.bad and self._bad_before(step) == 0:
                self._first_bad(step)
            self._count(step)

    def finish(self) -> list[Finding]:
        """The last check of the weights, after the last step (one host sync, once)."""
        self.intact = not self.weights.changed(self.host.optimizers)
        if self.intact or self._reported_bad_weights:
            return []
        self._reported_bad_weights = True
        return [self._bad_weights_finding(self.host.step, after=True)]

    # --- the judge: inside the optimizer step ----------------------------------------------

    def _first_evaluation(self, optimizer: torch.optim.Optimizer) -> None:
        """An evaluating optimizer (LBFGS) evaluated its closure once: a step that no hook
        measured yet is measured now, as it started (its later evaluations are not the step)."""
        step = self.batch.current(optimizer)
        if step is None or step.decision is not None:
            self._measure(optimizer)

    def evaluating(self) -> bool:
        """An evaluating optimizer's step is under way and measured: what its closure does
        now (another forward, another loss) is not a new micro-batch or loss of the step."""
        opt = self.guard.evaluating
        step = self.batch.current(opt) if opt is not None else None
        return step is not None and step.decision is None

    def _timed_judge(self, optimizer: torch.optim.Optimizer) -> Decision:
        with self._part("guard"):  # the monitor's cost
            return self._judge(optimizer)

    def _judge(self, optimizer: torch.optim.Optimizer) -> Decision:
        step = self.batch.current(optimizer)
        if step is None or step.decision is not None:
            step = self._measure(optimizer)  # no hook measured it: measured now, at the step
        values = step.measurement.guard_values()  # the step's one host read
        if values and self._recount(step):
            values[NONFINITE_GRADS] = self._count_grads(optimizer)
        skip, reason = decide(
            values, lrs=self._lrs(optimizer), weights_bad=step.weights_bad,
            stepping_past=self._stepping_past(step.step),
        )  # fmt: skip
        verify = self.policy.guard_optimizer
        if verify is None:
            verify = bool(risky_arithmetic(optimizer, values.get(GRAD_NORM, math.inf)))
        step.decision = Decision(skip, reason, verify)
        if skip:
            self.weights.buffers.end(restore=True)  # at once: before any other callback looks
        if skip and step.bad:
            self._replay(step)  # before the step, as the user's code saw it
        return step.decision

    def _recount(self, step: InFlight) -> bool:
        """Whether the gradients may have changed since they were measured (see the module)."""
        host = self.host
        if host.recount:
            return True
        if host.facts.world_size > 1:
            return False  # version counters are per rank; every rank must decide alike
        probe = step.measurement.probe
        if probe is None or probe.untouched():
            return False
        clip = host.clip
        return not (clip is not None and 0 < clip < math.inf)  # the host's clipping is finite

    def _count_grads(self, optimizer: torch.optim.Optimizer) -> float:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        count = count_nonfinite(grads, device)
        if self.host.facts.world_size > 1:  # every rank counts, so every rank decides alike
            count = self.host.reduce_sum(count)
        return float(count)

    def _lrs(self, optimizer: torch.optim.Optimizer) -> list[float]:
        factor = self._lr_factor()
        return [_float(g["lr"]) * factor for g in optimizer.param_groups]

    def _reverted(self, optimizer: torch.optim.Optimizer) -> None:
        step = self.batch.current(optimizer)
        if step is not None:
            step.reverted = True

    # --- after the step --------------------------------------------------------------------

    def _weights_checked(self, step: InFlight) -> None:
        if step.measurement.numbers is None:
            return
        self.intact = not step.weights_bad
        if step.weights_bad and not self._reported_bad_weights:
            self._reported_bad_weights = True
            step.found.append(self._bad_weights_finding(step.step, after=False))
        elif not step.weights_bad:
            self._reported_bad_weights = False

    def _bad_weights_finding(self, step: int, *, after: bool) -> Finding:
        first = self.weights.first_changed(self.host.optimizers)
        when = "after the last step" if after else f"before step {step}"
        message = (
            f"non-finite values in the weights {when} ({first}): an update that was let through, "
            "or code outside the optimizer, made them so; the weights are NOT intact. Resume "
            "from the last good checkpoint, and see docs/protection.md for what the guard "
            "cannot see"
        )
        return Finding(
            "nonfinite_update", step, step, Severity.CRITICAL, message,
            {"checked_step": float(step)}, ("optimizer",), ("rollback",),
        )  # fmt: skip

    def _first_bad(self, step: InFlight) -> None:
        """The findings of a first bad step that only the monitor knows (no replay needed)."""
        if step.reason == UNCHECKED or step.measurement.numbers is None:
            step.found.append(step.unchecked())
        elif step.reason == BAD_LR:  # the cause is known: no replay of the batch
            step.found.append(_bad_lr_finding(step))

    def _replay(self, step: InFlight) -> None:
        """Name the cause of the first bad step of an episode: replay its micro-batches."""
        micro = self.batch.micro
        if (
            step.replayed
            or self._bad_before(step)
            or step.reason in (UNCHECKED, BAD_LR, BAD_WEIGHTS)
            or step.weights_bad
            or not self.batch.keep_batches
            or not micro
            or micro[0].batch is None
        ):
            return
        step.replayed = True
        self.root_causes += 1  # every rank replays: the answers are gathered from all of them
        with self._part("replay"):
            found = root_cause(
                self.host, micro, step.measurement.loss_scale, self.guard, step.step,
                strict=self.strict, quiet=self._quiet, held=self.weights.held,
            )  # fmt: skip
        if found is not None:
            step.found.append(found)

    def _count(self, step: InFlight) -> None:
        """Skips and bad steps in a row: every rank counts the same, so every rank stops."""
        self.skipped_steps += int(step.skipped)
        index = step.measurement.optimizer_index
        bad = self._bad_before(step) + 1 if step.bad or step.reverted else 0
        self.bad_runs[index] = bad
        stop_after = self.policy.stop_after
        if step.weights_bad:
            self.stop(step, "the weights are not finite")
        elif stop_after is not None and bad >= stop_after:
            why = "unchecked" if step.measurement.numbers is None else "non-finite"
            of = f" of optimizer {index + 1}" if index else ""
            self.stop(step, f"{bad} {why} steps{of} in a row")

    @property
    def bad_in_a_row(self) -> int:
        """The longest current run of bad steps (each optimizer counts its own steps)."""
        return max(self.bad_runs.values(), default=0)

    def _bad_before(self, step: InFlight) -> int:
        """Bad steps in a row of `step`'s optimizer before it."""
        return self.bad_runs.get(step.measurement.optimizer_index, 0)

    def stop(self, step: InFlight | None, why: str) -> None:
        """Stop gracefully, saying what was checked of the weights."""
        host = self.host
        host.stop()
        path = host.checkpoint
        where = f"; last checkpoint: {path}" if path else "; no checkpoint was saved"
        where = where if path is not None else ""  # the host cannot tell
        if step is not None and not step.weights_bad and step.measurement.numbers is not None:
            state = f"weights checked finite before step {step.step}"
            state += ", its update skipped" if step.skipped else ""
        else:
            state = "the weights are NOT intact"
        if host.facts.is_global_zero:
            at = step.step if step is not None else host.step
            log.error("stabilizer: stopping at step %d: %s (%s)%s", at, why, state, where)


def _bad_lr_finding(step: InFlight) -> Finding:
    lrs = ", ".join(f"{lr:g}" for lr in step.measurement.lrs)
    message = (
        f"the learning rate is non-finite or negative at step {step.step} (param groups: {lrs}):"
        " the update would be too; step skipped before the optimizer ran. Check the LR "
        "scheduler (a division by a zero step count, a NaN read from a config)"
    )
    evidence = {f"lr_{i}": lr for i, lr in enumerate(step.measurement.lrs)}
    return Finding(
        "nonfinite_update", step.step, step.step, Severity.ERROR, message, evidence,
        ("optimizer",), ("skip_step",),
    )  # fmt: skip


def _float(lr: object) -> float:
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)  # type: ignore[arg-type]
