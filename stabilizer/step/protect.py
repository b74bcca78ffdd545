"""What each policy does with a step beyond reporting it: `Watching` (``observe``) and
`Protection` (``protect``, ``auto``), one class each with the same methods, so the run calls
them without asking which policy it has (`stabilizer.step.monitor.RUNTIMES`).

`Protection`, each rule with one home:

- the decision (`decide`), inside every optimizer step, after every hook and the clipping, on
  the gradients and the LR as the step will use them. The measurement is reused when nothing
  can have touched the gradients since (the host runs no code of its own between, their tensors
  and torch's version counters are unchanged, or only the host's finite clipping ran);
  otherwise the gradients are counted again, once;
- the weights' check (`stabilizer.step.weights.WeightsWatch`), folded into each measurement: a
  step that finds a value turned non-finite is skipped and reported as critical, the weights
  are not intact, and the run stops (`Auto` rolls back instead);
- a skipped step's buffers put back; the first bad step of an episode replayed to name its
  cause (`stabilizer.step.own_findings.root_cause`), with no optimizer able to step inside;
- the counting: each step's end (`after`) answers ``(should_stop, reason)``, as Lightning's
  ``EarlyStopping`` does; the run acts on it in one place.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from stabilizer.core.records import Finding, StepRecord
from stabilizer.core.signals import GRAD_NORM, NONFINITE_GRADS
from stabilizer.live.tensors import count_nonfinite

from .guard import BAD_LR, BAD_WEIGHTS, UNCHECKED, Decision, decide, risky_arithmetic
from .host import Host
from .measurement import WeightsCheck
from .own_findings import first_bad, root_cause, weights_not_intact
from .policies import Observe, Protect
from .ranks import Ranks
from .step import InFlight, OptimizerStep, Stage
from .weights import WeightsWatch

__all__ = ["GO", "Protection", "Remedies", "Watching"]

log = logging.getLogger("stabilizer")

GO = Decision(False)
Quiet = Callable[[], AbstractContextManager[None]]


class Watching:
    """``observe``: every step measured (at the latest inside its optimizer step) and let
    through as written; nothing checked, skipped or stopped.

    Args:
        host: The training loop.
        block: The block in flight (the run's).
        policy: The policy's knobs.
        ranks: The run's processes.
        quiet: The monitor's context in which its own hooks ignore what runs (a replay).
        strict: Raise on an internal error instead of warning.
    """

    protects = False

    def __init__(
        self,
        host: Host,
        block: InFlight,
        policy: Observe | Protect,
        ranks: Ranks,
        quiet: Quiet,
        strict: bool,
    ) -> None:
        self.host, self.block, self.ranks, self.quiet, self.strict = (
            host, block, ranks, quiet, strict,
        )  # fmt: skip
        self.root_causes = 0
        self.intact: bool | None = None  # the last check of the weights (None: none)
        # The fast check of the weights folded into each measurement (None: none).
        self.check: WeightsCheck | None = None
        self._set_up(policy)

    def _set_up(self, policy: Observe | Protect) -> None:
        """What the runtime of `policy` holds beside the run's parts."""

    def begin(self, step: int, optimizers: Sequence[torch.optim.Optimizer]) -> list[Finding]:
        """A block's first micro-batch starts (before its forward; `optimizers`: the host's,
        now); its notes."""
        return []

    def measured(self, step: OptimizerStep) -> None:
        """A step was measured (before its optimizer runs)."""

    def decide(
        self, step: OptimizerStep, optimizer: torch.optim.Optimizer, stepping_past: bool
    ) -> Decision:
        """The decision on a measured step (its numbers read)."""
        return GO

    def skipped(self, step: OptimizerStep) -> None:
        """The guard withheld the step."""

    def end(self, steps: Sequence[OptimizerStep]) -> tuple[bool, str]:
        """The block's steps ended (none abandoned): ``(should_stop, reason)``."""
        return False, ""

    def restart(self) -> None:
        """Training restarted from a snapshot (``auto``): what came before is no run of bad
        steps of this one."""

    def finish(self) -> list[Finding]:
        """After the last step: the last check's findings."""
        return []

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Back to a checkpoint's counters."""


class Protection(Watching):
    """``protect`` and ``auto``: skip what is not finite, check what is let through, name the
    cause, stop a run that stays broken (the module)."""

    protects = True
    policy: Protect

    def _set_up(self, policy: Observe | Protect) -> None:
        assert isinstance(policy, Protect)
        self.policy = policy
        self.weights = WeightsWatch(self.host.module)
        self.check = self.weights.to_check
        self.bad_runs: dict[int, int] = {}  # optimizer index -> its consecutive bad steps
        self._reported_bad_weights = False
        self._replayed: object = None  # the first micro-batch of the last replay

    def begin(self, step: int, optimizers: Sequence[torch.optim.Optimizer]) -> list[Finding]:
        """Copy the buffers, learn what is new; whether to keep the inputs for a replay."""
        self.block.keep_batches = (
            self.policy.root_cause and self.root_causes < self.policy.max_root_causes
        )
        return self.weights.begin(optimizers, step)

    def measured(self, step: OptimizerStep) -> None:
        """Under a grad scaler a NaN loss makes NaN gradients: the scaler, not the guard, skips
        that step, so its replay runs here, before the scaler (this reads the numbers now)."""
        m = step.measurement
        if m is not None and m.scaled and step.read() is not None and step.bad:
            self._replay(step)

    def decide(
        self, step: OptimizerStep, optimizer: torch.optim.Optimizer, stepping_past: bool
    ) -> Decision:
        """`decide` on the step's numbers (counted again where they may have changed), the
        weights' check, and whether the optimizer's own arithmetic is to be verified."""
        values = step.guard_values()  # (its numbers: read at the decision)
        if values and step.weights_nonfinite == 0 and self._suspect(step):
            step.count_weights(self.weights.count(optimizer, self.weights.buffers_nonfinite))
        if values and self._recount(step):
            values[NONFINITE_GRADS] = self._count_grads(optimizer)
        m = step.measurement
        assert m is not None  # (measured before it is decided)
        skip, reason = decide(
            values, lrs=m.lrs, weights_bad=step.weights_bad, stepping_past=stepping_past,
            scaled=m.scaled,
        )  # fmt: skip
        verify = self.policy.guard_optimizer
        if verify is None:
            verify = bool(risky_arithmetic(optimizer, values.get(GRAD_NORM, math.inf)))
        return Decision(skip, reason, verify)

    def _suspect(self, step: OptimizerStep) -> bool:
        numbers = step.numbers
        return numbers is not None and numbers.weights > 0

    def skipped(self, step: OptimizerStep) -> None:
        """The buffers back at once (before any other callback looks); a first bad step
        replayed, before the step, as the user's code saw it."""
        self.weights.buffers.end(restore=True)
        if step.bad:
            self._replay(step)

    def _recount(self, step: OptimizerStep) -> bool:
        """Whether the gradients may have changed since they were measured (the module)."""
        host, m = self.host, step.measurement
        if m is None or not step.measured_before:
            return False  # measured inside the step: nothing ran in between
        if host.recount:
            return True
        if self.ranks.world_size > 1:
            return False  # version counters are per rank; every rank must decide alike
        if m.probe is None or m.probe.untouched():
            return False
        clip = host.clip
        return not (clip is not None and 0 < clip < math.inf)  # the host's clipping is finite

    def _count_grads(self, optimizer: torch.optim.Optimizer) -> float:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        return float(self.ranks.sum(count_nonfinite(grads, device)))  # every rank alike

    # --- after the step ----------------------------------------------------------------------

    def end(self, steps: Sequence[OptimizerStep]) -> tuple[bool, str]:
        """The block's steps ended: the buffers back if one was skipped (a scaler's skip), each
        step's check of the weights, the findings of a first bad step that only the monitor
        knows, the bad steps in a row; ``(should_stop, reason)``, the first that says stop."""
        self.weights.buffers.end(restore=any(step.skipped for step in steps))
        answer = False, ""
        for step in steps:
            stop, why = self._after(step)
            if stop and not answer[0]:
                answer = stop, why
        return answer

    def _after(self, step: OptimizerStep) -> tuple[bool, str]:
        if step.skipped and step.checked:
            # after any restore: what "weights intact" beside it says, counted in full
            step.count_weights(self.weights.count(*self._counted(step)))
        self._weights_checked(step)
        index, failed = step.optimizer_index, step.bad
        before = self.bad_runs.get(index, 0)
        if failed and before == 0:
            step.found.extend(first_bad(step))
        bad = before + 1 if failed or step.ended is Stage.REVERTED else 0
        self.bad_runs[index] = bad
        if step.weights_bad:
            return True, "the weights are not finite"
        stop_after = self.policy.stop_after
        if stop_after is not None and bad >= stop_after:
            why = "unchecked" if not step.checked else "non-finite"
            of = f" of optimizer {index + 1}" if index else ""
            return True, f"{bad} {why} steps{of} in a row"
        return False, ""

    def _counted(self, step: OptimizerStep) -> tuple[torch.optim.Optimizer, torch.Tensor | None]:
        optimizers = self.host.optimizers
        index = step.optimizer_index if step.optimizer_index < len(optimizers) else 0
        return optimizers[index], self.weights.buffers_nonfinite

    def restart(self) -> None:
        self.bad_runs = {}

    @property
    def bad_in_a_row(self) -> int:
        """The longest current run of bad steps (each optimizer counts its own steps)."""
        return max(self.bad_runs.values(), default=0)

    def _weights_checked(self, step: OptimizerStep) -> None:
        if not step.checked:
            return
        self.intact = not step.weights_bad
        if step.weights_bad and not self._reported_bad_weights:
            self._reported_bad_weights = True
            step.found.append(self._bad_weights(step.step, after=False))
        elif not step.weights_bad:
            self._reported_bad_weights = False

    def finish(self) -> list[Finding]:
        """The last check of the weights, after the last step (one host sync, once)."""
        self.intact = not self.weights.changed(self.host.optimizers)
        if self.intact or self._reported_bad_weights:
            return []
        self._reported_bad_weights = True
        return [self._bad_weights(self.host.step, after=True)]

    def _bad_weights(self, step: int, *, after: bool) -> Finding:
        return weights_not_intact(step, self.weights.first_changed(self.host.optimizers), after)

    def _replay(self, step: OptimizerStep) -> None:
        """Name the cause of the first bad step of an episode: replay its micro-batches."""
        micro = step.micro
        if (
            step.replayed
            or (micro and micro[0] is self._replayed)  # (two optimizers of one block: once)
            or self.bad_runs.get(step.optimizer_index, 0)
            or step.reason in (UNCHECKED, BAD_LR, BAD_WEIGHTS)
            or step.weights_bad
            or not self.block.keep_batches
            or not micro
            or micro[0].batch is None
        ):
            return
        step.replayed, self._replayed = True, micro[0]
        self.root_causes += 1  # every rank replays: the answers are gathered from all of them
        m = step.measurement
        scale = step.numbers.scale if step.numbers is not None and m and m.scaled else 1.0
        found = root_cause(
            self.host, micro, scale, self.ranks, step.step, strict=self.strict, quiet=self.quiet,
            held=self.weights.held,
        )  # fmt: skip
        if found is not None:
            step.found.append(found)

    def state_dict(self) -> dict[str, Any]:
        """The counters a checkpoint keeps (in the monitor's state)."""
        return {
            "bad_in_a_row": self.bad_in_a_row, "bad_runs": dict(self.bad_runs),
            "root_causes": self.root_causes,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        runs = state.get("bad_runs") or {0: state.get("bad_in_a_row", 0)}
        self.bad_runs = {int(k): int(v) for k, v in runs.items()}
        self.root_causes = int(state.get("root_causes", 0))


class Remedies:
    """The remedies of a policy that applies none (``observe``, ``protect``): every answer is
    "nothing", so the run asks without asking which policy it has.

    Args:
        host: The training loop.
        policy: The policy's knobs.
    """

    def __init__(self, host: Host, policy: object) -> None:
        self.host = host
        self.applied: dict[str, int] = {}  # remedy name -> times applied

    @property
    def lr_factor(self) -> float:
        """The LR multiplier in force."""
        return 1.0

    def stepping_past(self, step: int) -> bool:
        """Whether `step`'s update is skipped to step past bad data after a rollback."""
        return False

    def start(self, resumed: bool) -> None:
        """The run starts (`resumed`: from a checkpoint's state, its remedies put back)."""

    def stop(self) -> None:
        """The run is over: the remedies' hooks removed."""

    def after_step(
        self, step: int, found: Sequence[Finding], record: StepRecord | None = None
    ) -> list[Finding]:
        """What the step's findings call for: the findings of what was done."""
        return []

    def should_stop(self) -> tuple[bool, str]:
        """``(should_stop, reason)`` after the last `after_step`."""
        return False, ""

    def state_dict(self) -> dict[str, object]:
        return {}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Back to a checkpoint's state."""
