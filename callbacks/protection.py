"""``Protection``: the rules of policies ``protect`` and ``auto``, each with one home.

- The guard (`StepGuard`) calls `judge` inside every optimizer step, after every hook and the
  clipping: the decision (`decide`) is taken on the gradients and the LR as the step will use
  them. The measurement of ``on_before_optimizer_step`` is reused when nothing can have touched
  the gradients since (no user code runs after the monitor's hook, their tensors and torch's
  version counters are unchanged, or only Lightning's own clipping of finite gradients ran);
  otherwise the gradients are counted again, once.
- Every measurement also counts the tensors among the parameters, optimizer state and buffers
  that turned non-finite (`weights_check`: the check that nothing since the last step, the
  update or code outside it, made a finite value NaN/Inf; read with the step's one host read);
  a step that finds one is skipped and reported as critical: the weights are not intact, and the
  run stops (``auto`` rolls back instead). What a model holds as NaN/Inf by design when a tensor
  is first seen (a ``-inf`` causal mask, observers' ``+-inf``) is said once and never judged
  (`stabilizer.live.held.HeldNonFinite`).
- A skipped step's buffers are put back (`BufferWatch`); the first bad step of an episode is
  replayed to name its cause (`root_cause`), with no optimizer able to step inside.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from stabilizer.core.kinds import NONFINITE_HELD
from stabilizer.core.records import Finding, Severity
from stabilizer.core.signals import GRAD_NORM, NONFINITE_GRADS
from stabilizer.live.buffers import BufferWatch, registrations
from stabilizer.live.held import Held, HeldNonFinite
from stabilizer.live.rootcause import capture_rng
from stabilizer.live.tensors import count_nonfinite, count_suspect, optimizer_state_tensors

from .checks import root_cause
from .guard import (
    BAD_LR,
    BAD_WEIGHTS,
    UNCHECKED,
    StepGuard,
    Verdict,
    decide,
    held_tensors,
    risky_arithmetic,
)
from .live_step import LiveStep
from .measured import Measured

__all__ = ["CPU_SHARES", "Protection", "user_code_after"]

log = logging.getLogger("stabilizer")

CPU_SHARES = 8
"""On the CPU each step checks an eighth of the parameters, in turn (and all of the optimizer
state, which nothing else would show before it reached the weights)."""


def user_code_after(trainer: pl.Trainer, pl_module: pl.LightningModule, me: pl.Callback) -> bool:
    """Whether code other than Lightning's own clipping runs between the monitor's
    ``on_before_optimizer_step`` and the optimizer step: a later callback's hook, the module's
    ``on_before_optimizer_step`` or ``configure_gradient_clipping``."""
    callbacks = list(getattr(trainer, "callbacks", []))
    later = callbacks[callbacks.index(me) + 1 :] if me in callbacks else []
    hook = pl.Callback.on_before_optimizer_step
    if any(type(cb).on_before_optimizer_step is not hook for cb in later):
        return True
    base = pl.LightningModule
    return (
        type(pl_module).on_before_optimizer_step is not base.on_before_optimizer_step
        or type(pl_module).configure_gradient_clipping is not base.configure_gradient_clipping
    )


class Protection:
    """The guard, its judge, the buffers, the counting and the stop of a protected run.

    Args:
        live: The state of the batch in flight (shared with the monitor).
        verify: ``guard_optimizer``: copy-and-check every step (True), never (False), or where
            the optimizer's arithmetic can overflow (None).
        stop_after: Stop after this many bad steps in a row (None: never).
        root_cause: Replay the first bad step of each episode; at most `max_root_causes`.
        max_root_causes: Replays allowed over the run.
        lr_factor: The LR multiplier in force (policy ``auto``), read at each step.
        stepping_past: Whether ``auto`` is stepping past bad data at a step.
        inert: The monitor's context in which its own hooks ignore what runs (a replay).
        strict: Raise on an internal error instead of warning.
    """

    def __init__(
        self,
        live: LiveStep,
        *,
        verify: bool | None,
        stop_after: int | None,
        root_cause: bool,
        max_root_causes: int,
        lr_factor: Callable[[], float],
        stepping_past: Callable[[int], bool],
        inert: Callable[[], AbstractContextManager[None]],
        strict: bool,
        part: Callable[[str], AbstractContextManager[None]] | None = None,
    ) -> None:
        self.live, self.verify, self.stop_after = live, verify, stop_after
        self.root_cause, self.max_root_causes, self.strict = root_cause, max_root_causes, strict
        self._lr_factor, self._stepping_past, self._inert = lr_factor, stepping_past, inert
        self._part = part or (lambda name: nullcontext())
        self.guard = StepGuard(self._timed_judge, self._reverted)
        self.bad_runs: dict[int, int] = {}  # optimizer index -> its consecutive bad steps
        self.skipped_steps = 0  # optimizer steps skipped, by the guard or by a grad scaler
        self.root_causes = 0
        self.intact: bool | None = None  # the last check of the weights: None before any
        self._reported_bad_weights = False
        self._user_after = False
        self._buffers: BufferWatch | None = None
        self.buffers_nonfinite: torch.Tensor | None = None  # the buffers' check of this step
        self.held = HeldNonFinite()  # what the model holds as NaN/Inf by design
        self._learned: tuple[int, ...] | None = None  # what `_learn` last saw
        self._notes: list[Finding] = []  # tensors found holding NaN/Inf: said with the next step
        self._fit: tuple[pl.Trainer, pl.LightningModule] | None = None

    def state_dict(self) -> dict[str, Any]:
        """The counters a checkpoint keeps (in the monitor's state)."""
        return {
            "bad_in_a_row": self.bad_in_a_row, "bad_runs": dict(self.bad_runs),
            "skipped_steps": self.skipped_steps,
            "root_causes": self.root_causes, "skipped": self.guard.skipped,
            "reverted": self.guard.reverted,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        runs = state.get("bad_runs") or {0: state.get("bad_in_a_row", 0)}
        self.bad_runs = {int(k): int(v) for k, v in runs.items()}
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.root_causes = int(state.get("root_causes", 0))
        self.guard.skipped = int(state.get("skipped", 0))
        self.guard.reverted = int(state.get("reverted", 0))

    # --- fit and batch boundaries ------------------------------------------------------------

    def start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, me: pl.Callback) -> None:
        self._fit = trainer, pl_module
        self._user_after = user_code_after(trainer, pl_module, me)
        self._buffers = BufferWatch(pl_module)
        self.guard.cover(trainer.optimizers)

    def begin_batch(self, trainer: pl.Trainer, batch: object, index: int) -> None:
        """Guard any optimizer created or replaced since; note the micro-batch and buffers."""
        self.guard.cover(trainer.optimizers)
        self.live.keep_batches = self.root_cause and self.root_causes < self.max_root_causes
        rng = capture_rng() if self.live.keep_batches else None
        if self.live.begin(batch, index, rng) and self._buffers is not None and self._fit:
            self._buffers.begin()
            module = self._fit[1]
            self._learn(trainer, module)
            # Before the forward: the check covers what earlier steps left (a skipped step's
            # own forward is undone by `BufferWatch`). A device count: read with the step.
            device = next((p.device for p in module.parameters()), torch.device("cpu"))
            noted = self._buffers.buffers
            whole, partial = self.held.split([b for _, b in noted], [k for k, _ in noted])
            count = count_nonfinite(whole, device)
            self.buffers_nonfinite = count + self.held.count_new(partial, device)

    def _learn(self, trainer: pl.Trainer, module: nn.Module) -> None:
        """Learn what each parameter and buffer holds when first seen (and the optimizer state
        at the first batch, a resumed run's): where it is NaN/Inf already, that is by design,
        said once, never judged. Looked at again only when a module registered something or a
        param group changed (cheap otherwise)."""
        optimizers = trainer.optimizers
        sizes = tuple(len(g["params"]) for opt in optimizers for g in opt.param_groups)
        seen = (registrations(), *sizes)
        if seen == self._learned:
            return
        first, self._learned = self._learned is None, seen
        named: list[tuple[Any, str, torch.Tensor]] = [
            (id(p), f"parameter {name}", p) for name, p in module.named_parameters()
        ]
        for prefix, owner in module.named_modules():
            named += [
                ((id(owner), name), f"buffer {prefix + '.' if prefix else ''}{name}", b)
                for name, b in owner._buffers.items()
                if b is not None
            ]
        for i, opt in enumerate(optimizers):
            named += [(id(p), f"optimizer {i}'s tensor", p) for g in opt.param_groups
                      for p in g["params"]]  # fmt: skip
            if first:
                state = optimizer_state_tensors(opt)
                named += [(id(t), f"optimizer {i}'s state", t) for t in state]
        step = trainer.global_step
        self._notes += [_held_finding(h, step, first) for h in self.held.learn(named)]

    def weights_check(
        self, optimizer: torch.optim.Optimizer, step: int, device: torch.device
    ) -> torch.Tensor:
        """The fast test before `optimizer` steps (a device scalar, nothing waits): above 0 when
        a value turned non-finite among its parameters and state, or among the buffers before
        this step's forward. Every state tensor is tested every step (a NaN written into Adam's
        moments outside the step shows in no loss or gradient before it reaches the weights);
        the parameters too on an accelerator, a `CPU_SHARES`-th in turn on the CPU (a NaN
        parameter also makes the next loss NaN, and that step is then checked in full)."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if device.type == "cpu":
            params = params[step % CPU_SHARES :: CPU_SHARES]
        whole, partial = self.held.split([*params, *optimizer_state_tensors(optimizer)])
        count = count_suspect(whole, device) + self.held.count_new(partial, device)
        if self.buffers_nonfinite is not None:
            count = count + self.buffers_nonfinite.to(device)
        return count

    def _count_changed(
        self, optimizer: torch.optim.Optimizer, buffers: torch.Tensor | None
    ) -> float:
        """How many of the optimizer's parameters and state, and of the buffers before this
        step, turned non-finite: exact, over all of them (a sync)."""
        whole, partial = self.held.split(held_tensors(optimizer))
        devices = {t.device for t in whole} | {t.device for t, _ in partial}
        count = sum(float(count_nonfinite(whole, d)) for d in devices)
        if partial:
            count += float(self.held.count_new(partial, partial[0][0].device))
        return count + (float(buffers) if buffers is not None else 0.0)

    def evaluating_again(self, optimizer: torch.optim.Optimizer) -> bool:
        """A closure evaluated again inside one step (LBFGS): that step was measured once; the
        evaluation's loss is dropped."""
        step = self.live.current(optimizer)
        if self.guard.evaluating is not optimizer or step is None or step.judged:
            return False
        self.live.step_loss()
        return True

    def measured(self, optimizer: torch.optim.Optimizer, step: Measured) -> None:
        """A step was measured in ``on_before_optimizer_step``. An optimizer that is not
        guarded yet (replaced inside this batch) is guarded from its next step on; this one is
        judged here, the latest point left, and a skip drops its gradients (torch optimizers
        pass over parameters without one)."""
        buffers = self.buffers_nonfinite
        step.recount = lambda: self._count_changed(optimizer, buffers)
        step.found += self._notes  # tensors found holding NaN/Inf by design: said once
        self._notes = []
        if step.scaled and step.bad:
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

    def end_batch(self, trainer: pl.Trainer, steps: Sequence[Measured]) -> None:
        """After the batch's steps: buffers back if one was skipped (a scaler's skip), the
        weights' check, the monitor's own findings of a first bad step, counting and stop."""
        if self._buffers is not None:
            self._buffers.end(restore=any(s.skipped for s in steps))
        for step in steps:
            if step.skipped and step.numbers is not None:
                step.check_all()  # after any restore: what "weights intact" beside it says
            self._weights_checked(trainer, step)
            if step.bad and self._bad_before(step) == 0:
                self._first_bad(step)
            self._count(trainer, step)

    def finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[Finding]:
        """The last check of the weights, after the last step (one host sync, once)."""
        self.intact = not self._changed(trainer, pl_module)
        if self.intact or self._reported_bad_weights:
            return []
        self._reported_bad_weights = True
        return [self._bad_weights_finding(trainer, trainer.global_step, after=True)]

    # --- the judge: inside the optimizer step ----------------------------------------------

    def _timed_judge(self, optimizer: torch.optim.Optimizer) -> Verdict:
        with self._part("guard"):  # the monitor's cost
            return self._judge(optimizer)

    def _judge(self, optimizer: torch.optim.Optimizer) -> Verdict:
        step = self.live.current(optimizer)
        if step is None or step.judged:
            # Stepped outside Lightning's hooks (a raw optimizer's step): nothing measured it.
            values = self._fresh_values(optimizer)
            return Verdict(skip=decide(values, lrs=self._lrs(optimizer))[0], verify=True)
        step.judged = True
        values = step.guard_values()  # the step's one host read
        if values and self._recount(step):
            values[NONFINITE_GRADS] = self._count_grads(optimizer)
        stepping_past = self._stepping_past(step.step)
        step.skip, step.reason = decide(
            values, lrs=self._lrs(optimizer), weights_bad=step.weights_bad,
            stepping_past=stepping_past,
        )  # fmt: skip
        if step.skip and self._buffers is not None:
            self._buffers.end(restore=True)  # at once: before any other callback looks
        if step.skip and step.bad:
            self._replay(step)  # before the step, as the user's code saw it
        if self.verify is not None:
            return Verdict(step.skip, self.verify)
        risky = risky_arithmetic(optimizer, values.get(GRAD_NORM, math.inf))
        return Verdict(step.skip, bool(risky))

    def _recount(self, step: Measured) -> bool:
        """Whether the gradients may have changed since they were measured (see the module)."""
        trainer = self._trainer
        if self._user_after:
            return True
        if trainer.world_size > 1:
            return False  # version counters are per rank; every rank must decide alike
        if step.probe is None or step.probe.untouched():
            return False
        clip = trainer.gradient_clip_val
        return not (clip is not None and 0 < clip < math.inf)  # Lightning's clipping is finite

    def _count_grads(self, optimizer: torch.optim.Optimizer) -> float:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        count = count_nonfinite(grads, device)
        trainer = self._trainer
        if trainer.world_size > 1:  # every rank counts, so every rank decides alike
            count = trainer.strategy.reduce(count, reduce_op="sum")
        return float(count)

    def _fresh_values(self, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        return {GRAD_NORM: 0.0, NONFINITE_GRADS: self._count_grads(optimizer)}

    def _lrs(self, optimizer: torch.optim.Optimizer) -> list[float]:
        factor = self._lr_factor()
        return [_float(g["lr"]) * factor for g in optimizer.param_groups]

    def _reverted(self, optimizer: torch.optim.Optimizer) -> None:
        step = self.live.current(optimizer)
        if step is not None:
            step.reverted = True

    @property
    def _trainer(self) -> pl.Trainer:
        assert self._fit is not None, "Protection.start was not called"
        return self._fit[0]

    # --- after the step --------------------------------------------------------------------

    def _weights_checked(self, trainer: pl.Trainer, step: Measured) -> None:
        if step.numbers is None:
            return
        self.intact = not step.weights_bad
        if step.weights_bad and not self._reported_bad_weights:
            self._reported_bad_weights = True
            step.found.append(self._bad_weights_finding(trainer, step.step, after=False))
        elif not step.weights_bad:
            self._reported_bad_weights = False

    def _changed(self, trainer: pl.Trainer, module: nn.Module) -> bool:
        """Whether any parameter, optimizer state or buffer turned non-finite (a sync)."""
        parts = list(_named_held(trainer.optimizers, module))
        plain = [t for _, ts, keys in parts if keys is None for t in ts]
        keys = [k for _, _, ks in parts if ks is not None for k in ks]
        buffers = [t for _, ts, ks in parts if ks is not None for t in ts]
        return self.held.changed(plain) or self.held.changed(buffers, keys)

    def _first_nonfinite(self, trainer: pl.Trainer, module: nn.Module) -> str:
        """The first tensor that turned non-finite (a failing step only: a sync per tensor)."""
        for name, tensors, keys in _named_held(trainer.optimizers, module):
            if self.held.changed(tensors, keys):
                return name
        return "another optimizer's tensors"

    def _bad_weights_finding(self, trainer: pl.Trainer, step: int, *, after: bool) -> Finding:
        fit = self._fit
        first = self._first_nonfinite(trainer, fit[1]) if fit is not None else "?"
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

    def _first_bad(self, step: Measured) -> None:
        """The findings of a first bad step that only the monitor knows (no replay needed)."""
        if step.reason == UNCHECKED or step.numbers is None:
            step.found.append(step.unchecked())
        elif step.reason == BAD_LR:  # the cause is known: no replay of the batch
            step.found.append(_bad_lr_finding(step))

    def _replay(self, step: Measured) -> None:
        """Name the cause of the first bad step of an episode: replay its micro-batches."""
        micro = self.live.micro
        if (
            step.replayed
            or self._bad_before(step)
            or step.reason in (UNCHECKED, BAD_LR, BAD_WEIGHTS)
            or step.weights_bad
            or not self.live.keep_batches
            or not micro
            or micro[0].batch is None
            or self._fit is None
        ):
            return
        step.replayed = True
        self.root_causes += 1  # every rank replays: the answers are gathered from all of them
        trainer, pl_module = self._fit
        with self._part("replay"):
            found = root_cause(
                trainer, pl_module, micro, step.loss_scale, self.guard, step.step, self.strict,
                self._inert, self.held,
            )  # fmt: skip
        if found is not None:
            step.found.append(found)

    def _count(self, trainer: pl.Trainer, step: Measured) -> None:
        """Skips and bad steps in a row: every rank counts the same, so every rank stops."""
        self.skipped_steps += int(step.skipped)
        bad = self._bad_before(step) + 1 if step.bad or step.reverted else 0
        self.bad_runs[step.optimizer_index] = bad
        if step.weights_bad:
            self.stop(trainer, step, "the weights are not finite")
        elif self.stop_after is not None and bad >= self.stop_after:
            why = "unchecked" if step.numbers is None else "non-finite"
            of = f" of optimizer {step.optimizer_index + 1}" if step.optimizer_index else ""
            self.stop(trainer, step, f"{bad} {why} steps{of} in a row")

    @property
    def bad_in_a_row(self) -> int:
        """The longest current run of bad steps (each optimizer counts its own steps)."""
        return max(self.bad_runs.values(), default=0)

    def _bad_before(self, step: Measured) -> int:
        """Bad steps in a row of `step`'s optimizer before it."""
        return self.bad_runs.get(step.optimizer_index, 0)

    def stop(self, trainer: pl.Trainer, step: Measured | None, why: str) -> None:
        """Stop gracefully, saying what was checked of the weights."""
        trainer.should_stop = True
        ckpt = trainer.checkpoint_callback
        path = getattr(ckpt, "last_model_path", "") or getattr(ckpt, "best_model_path", "")
        where = f"; last checkpoint: {path}" if path else "; no checkpoint was saved"
        if step is not None and not step.weights_bad and step.numbers is not None:
            state = f"weights checked finite before step {step.step}"
            state += ", its update skipped" if step.skipped else ""
        else:
            state = "the weights are NOT intact"
        if trainer.is_global_zero:
            at = step.step if step is not None else trainer.global_step
            log.error("stabilizer: stopping at step %d: %s (%s)%s", at, why, state, where)


def _named_held(
    optimizers: Sequence[torch.optim.Optimizer], module: nn.Module
) -> Iterator[tuple[str, list[torch.Tensor], list[Any] | None]]:
    """Parameters, optimizer state and buffers, what the protection keeps finite: ``(name,
    tensors, keys)`` (buffers are keyed by module and name, the rest by identity)."""
    for name, p in module.named_parameters():
        yield f"parameter {name}", [p], None
    for i, opt in enumerate(optimizers):
        yield f"optimizer {i}'s state", list(optimizer_state_tensors(opt)), None
        yield f"optimizer {i}'s tensors", [p for g in opt.param_groups for p in g["params"]], None
    for prefix, owner in module.named_modules():
        for name, b in owner._buffers.items():
            if b is not None:
                full = f"{prefix}.{name}" if prefix else name
                yield f"buffer {full}", [b], [(id(owner), name)]


def _held_finding(held: Held, step: int, first: bool) -> Finding:
    """The note that a tensor held NaN/Inf when first seen: by design, not judged."""
    when = "before training" if first else f"when first seen at step {step}"
    message = (
        f"{held.name} holds {held.count} of {held.total} values as {held.sample} {when}: "
        "held by design (a mask, an observer, an unused tensor), not judged; a value that "
        "turns non-finite from now on is"
    )
    evidence = {"nonfinite_values": float(held.count), "values": float(held.total)}
    return Finding(NONFINITE_HELD, step, step, Severity.INFO, message, evidence)


def _bad_lr_finding(step: Measured) -> Finding:
    lrs = ", ".join(f"{lr:g}" for lr in step.lrs)
    message = (
        f"the learning rate is non-finite or negative at step {step.step} (param groups: {lrs}):"
        " the update would be too; step skipped before the optimizer ran. Check the LR "
        "scheduler (a division by a zero step count, a NaN read from a config)"
    )
    evidence = {f"lr_{i}": lr for i, lr in enumerate(step.lrs)}
    return Finding(
        "nonfinite_update", step.step, step.step, Severity.ERROR, message, evidence,
        ("optimizer",), ("skip_step",),
    )  # fmt: skip


def _float(lr: object) -> float:
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)  # type: ignore[arg-type]
