"""``StepGuard``: every optimizer step passes through the guard, which decides at the last moment.

Zeroing the gradients is not skipping: AdamW would still apply momentum and weight decay, and
move every parameter. The guard replaces each optimizer's ``step`` by a bound method of its own
(the shape torch's LR schedulers and SWA wrap in turn) that, after the closure has run — the
training step, the backward, every ``on_before_optimizer_step`` hook, the clipping — asks its
judge (`Judge`: the run, `stabilizer.step.monitor.RunMonitor`) whether the step may go ahead,
on the gradients and the LR as the optimizer will use them, and tells it how the step ended. A
condemned step returns before the optimizer runs: parameters and optimizer state (moments, step
counters) stay exactly as they were. Under ``observe`` nothing is wrapped: the optimizer's own
step hooks tell the judge that a step is under way (it is measured there, if nothing measured it
before) and that it ran, and the step runs exactly as written.

Optimizers that evaluate their closure themselves, several times (LBFGS), cannot be judged
before they step: the guard copies their parameters and state, lets them step, and puts the copy
back when any evaluation or the result is non-finite (one step, however many evaluations). The
same copy-and-check (`verify`) runs wherever the optimizer's own arithmetic can overflow from
finite gradients: fp16/bf16 parameters, Adam-style ``eps=0``, a gradient so large that its
square overflows the optimizer's second moment.

While the guard is `inert` (the monitor's own replay of a step), no optimizer step happens at
all, and no decision of the real step is touched.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from stabilizer.core.signals import GRAD_NORM, LOSS, NONFINITE_GRADS
from stabilizer.live.inner import stepped_through
from stabilizer.live.tensors import all_finite, held_tensors, outside_compile

from .verify import restore, snapshot

__all__ = [
    "BAD_GRADS",
    "BAD_LOSS",
    "BAD_LR",
    "BAD_WEIGHTS",
    "HUGE_GRAD_NORM",
    "OVERFLOW",
    "STEPPING_PAST",
    "UNCHECKED",
    "Decision",
    "Judge",
    "StepGuard",
    "decide",
    "risky_arithmetic",
]

_LOW = (torch.float16, torch.bfloat16)

# Why `decide` skips a step.
BAD_LOSS = "non-finite loss"
BAD_GRADS = "non-finite gradients"
BAD_LR = "non-finite or negative learning rate"
BAD_WEIGHTS = "the weights are already non-finite"
UNCHECKED = "the step could not be measured"
STEPPING_PAST = "stepping past bad data after a rollback"
OVERFLOW = "the fp16 grad scaler's overflow (it skips the step and lowers its scale)"

_SKIPPED, _RAISED = object(), object()  # (`StepGuard._decide`: withheld; the step raised)

HUGE_GRAD_NORM = 1e18
"""A gradient norm from which an Adam-style second moment (the gradient squared) can overflow
fp32 (its largest value is 3.4e38): such a step is verified, not assumed finite."""


def decide(
    values: Mapping[str, float],
    *,
    lrs: Sequence[float | None] = (),
    weights_bad: bool = False,
    stepping_past: bool = False,
    scaled: bool = False,
) -> tuple[bool, str]:
    """Skip the coming optimizer step or not, and why: a pure function of the step's numbers.

    Args:
        values: The step's ``grad_norm`` and ``nonfinite_grads`` (an exact count) as the step
            will apply them, and its ``loss`` when a backward ran; empty when they could not be
            measured (then the step is skipped: nothing unchecked gets through).
        lrs: Each param group's learning rate as the step will use it; None where the
            optimizer computes its own (not checked).
        weights_bad: The check of the parameters, optimizer state and buffers before this step
            found a NaN/Inf (an earlier update, or something else, put it there).
        stepping_past: Policy ``auto`` is stepping past the bad data after a rollback (its own
            skip, whatever the step's numbers: they are reported, not counted as bad).
        scaled: An fp16 grad scaler runs: non-finite gradients of a finite loss are its
            overflow, which it skips and answers by lowering its scale.

    Returns:
        ``(skip, reason)``: the reason is empty when the step goes ahead.
    """
    if GRAD_NORM not in values or NONFINITE_GRADS not in values:
        return True, UNCHECKED
    if weights_bad:
        return True, BAD_WEIGHTS
    if stepping_past:
        return True, STEPPING_PAST
    if LOSS in values and not math.isfinite(values[LOSS]):
        return True, BAD_LOSS
    if values[NONFINITE_GRADS] > 0:
        return True, OVERFLOW if scaled else BAD_GRADS
    if any(lr is not None and not (math.isfinite(lr) and lr >= 0) for lr in lrs):
        return True, BAD_LR
    return False, ""


def risky_arithmetic(optimizer: torch.optim.Optimizer, grad_norm: float) -> str:
    """Why the optimizer's own arithmetic may overflow from finite gradients ("" when it
    cannot): low-precision parameters, an Adam-style ``eps`` of 0, a huge gradient."""
    groups = optimizer.param_groups
    if any(p.dtype in _LOW for g in groups for p in g["params"]):
        return "fp16/bf16 parameters"
    if any(g.get("eps", 1.0) == 0 and "betas" in g for g in groups):
        return "eps=0"
    if not grad_norm < HUGE_GRAD_NORM:
        return "a huge gradient"
    return ""


@dataclass(frozen=True)
class Decision:
    """The judge's answer for one optimizer step.

    Args:
        skip: Do not step.
        reason: Why (`decide`'s reasons); empty when the step goes ahead.
        verify: Step on a copy-and-check: put the copy back if the result is non-finite.
    """

    skip: bool
    reason: str = ""
    verify: bool = False


class Judge(Protocol):
    """What the guard asks, and tells, inside each guarded optimizer step."""

    def judge(self, optimizer: torch.optim.Optimizer) -> Decision:
        """After the closure: skip, verify or go (the step is measured first, if no moment
        before measured it)."""
        ...

    def ran(self, optimizer: torch.optim.Optimizer, outcome: str) -> None:
        """What became of the step: ``"stepped"``, ``"skipped"`` or ``"reverted"``."""
        ...

    def first_evaluation(self, optimizer: torch.optim.Optimizer) -> None:
        """An evaluating optimizer (LBFGS) evaluated its closure once: the step as it started,
        measured there by a host without a moment before the step."""
        ...


class StepGuard:
    """Guards the ``step`` of optimizers; the judge decides each step.

    Args:
        judge: Decides each guarded step and hears how it ended.
        protects: Whether it may skip and undo (``protect``, ``auto``: ``step`` is wrapped);
            without, each step is watched through the optimizer's step hooks and runs as
            written (``observe``).
    """

    def __init__(self, judge: Judge, protects: bool = True) -> None:
        self._judge, self.protects = judge, protects
        self.skipped = 0  # steps the guard skipped
        self.reverted = 0  # steps whose non-finite result the guard put back
        self.evaluating: torch.optim.Optimizer | None = None  # LBFGS-style step in progress
        self._inert = False
        self._generation = 0  # wrappers of an earlier fit (left inside others') pass through
        self._guarded: dict[int, tuple[torch.optim.Optimizer, Any]] = {}
        self._hooks: list[Any] = []  # the step hooks of optimizers watched (`observe`)
        self._decided: set[int] = set()  # watched optimizers decided before their step ran
        self._running: set[int] = set()  # optimizers whose own step is running (let through)

    def cover(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Guard each optimizer not guarded yet (new, or replaced mid-run): cheap when none is."""
        for opt in optimizers:
            if id(opt) not in self._guarded:
                self._wrap(opt) if self.protects else self._watch(opt)

    def covers(self, optimizer: torch.optim.Optimizer) -> bool:
        return id(optimizer) in self._guarded

    @contextmanager
    def inert(self) -> Iterator[None]:
        """No optimizer step happens inside (the monitor's own replay of a step)."""
        self._inert, before = True, self._inert
        try:
            yield
        finally:
            self._inert = before

    def uninstall(self) -> None:
        """Put each ``step`` back. A guard that others wrapped since passes straight through
        from now on, and is taken out as soon as it is on top again (a second monitor's guard
        above it, uninstalled in either order)."""
        self._generation += 1
        for opt, _ in self._guarded.values():
            _unwind(opt)
        self._guarded.clear()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _watch(self, opt: torch.optim.Optimizer, of: torch.optim.Optimizer | None = None) -> None:
        """Under ``observe``: no wrapper (the step runs exactly as written, closure and all);
        the optimizer's own step hooks tell the judge the step is under way and that it ran.
        A step with a closure is measured after it ran (its gradients come from the closure).
        With `of`, as in `_wrap`: a step of `opt` inside `of`'s own is not another step."""
        judge, guard, judged = self._judge, self, of if of is not None else opt

        def before(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if guard._inert or (of is not None and id(of) in guard._running):
                return
            guard._running.add(id(optimizer))
            closure = args[1] if len(args) > 1 else kwargs.get("closure")  # (args[0]: itself)
            if closure is None:
                judge.judge(judged)
                guard._decided.add(id(judged))

        def after(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if id(optimizer) not in guard._running:
                return  # (inert, or inside `of`'s own step)
            guard._running.discard(id(optimizer))
            if id(judged) not in guard._decided:
                judge.judge(judged)
            guard._decided.discard(id(judged))
            judge.ran(judged, "stepped")

        self._hooks += [
            opt.register_step_pre_hook(outside_compile(before)),
            opt.register_step_post_hook(outside_compile(after)),
        ]
        self._guarded[id(opt)] = (opt, None)
        base = stepped_through(opt) if of is None else None
        if base is not None and id(base) not in self._guarded:
            self._watch(base, of=opt)

    def _wrap(self, opt: torch.optim.Optimizer, of: torch.optim.Optimizer | None = None) -> None:
        """Guard `opt`'s step; with `of`, the one `of` steps through (`stepped_through`): let
        through inside `of`'s own step, judged as `of`'s when called alone (SAM's)."""
        previous = opt.__dict__.get("step")
        inner = opt.step  # bound: the class's step, or a wrapper set on the instance before us
        guard, generation = self, self._generation
        evaluates = isinstance(opt, torch.optim.LBFGS)
        judged = of if of is not None else opt

        def step(self: torch.optim.Optimizer, closure: Any = None, **kwargs: Any) -> Any:
            if guard._generation != generation or (of is not None and id(of) in guard._running):
                return inner(closure, **kwargs) if closure is not None else inner(**kwargs)
            if guard._inert:
                return None
            if evaluates:
                return guard._evaluating_step(self, inner, closure, kwargs)
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()  # the monitor measures inside (on_before_optimizer_step)
            decide, stepped = _OUTSIDE if torch.compiler.is_compiling() else _INSIDE
            saved = decide(guard, judged, kwargs, self)
            if saved is not _SKIPPED:
                ran = _RAISED
                try:
                    inner(**kwargs)
                    ran = saved
                finally:
                    stepped(guard, judged, self, ran)
            return loss

        # torch's LR schedulers wrap `step` as a bound method and mark it; keep the marks. The
        # signature stays the optimizer's own: a grad scaler passes `grad_scaler=` to a step
        # that takes it (`inspect.signature` follows `__wrapped__`).
        func = getattr(inner, "__func__", inner)
        step.__dict__.update(getattr(func, "__dict__", {}))
        step.__wrapped__ = func  # type: ignore[attr-defined]
        step._stabilizer_guard = self  # type: ignore[attr-defined]
        step._stabilizer_generation = generation  # type: ignore[attr-defined]
        step._stabilizer_previous = previous  # type: ignore[attr-defined]
        opt.step = types.MethodType(step, opt)  # type: ignore[method-assign]
        self._guarded[id(opt)] = (opt, previous)
        base = stepped_through(opt) if of is None else None
        if base is not None and id(base) not in self._guarded:
            self._wrap(base, of=opt)

    def _decide(self, opt: torch.optim.Optimizer, kwargs: Mapping[str, Any], by: Any) -> Any:
        """`opt`'s step, run `by` it or the one it steps through (whose state a copy-check
        copies): `_SKIPPED`, or the copy to check against (None: no copy)."""
        judge = self._judge
        decision = judge.judge(opt)
        if decision.skip:
            _scaler_whole(opt, kwargs)
            self.skipped += 1
            judge.ran(opt, "skipped")
            return _SKIPPED
        self._running.add(id(opt))
        return snapshot(by) if decision.verify else None

    def _stepped(self, opt: torch.optim.Optimizer, by: torch.optim.Optimizer, saved: Any) -> None:
        """`opt`'s step ran (`saved`: its copy, or None), said, and undone where its copy-check
        fails; or it raised (`_RAISED`): nothing is said of it."""
        self._running.discard(id(opt))
        if saved is _RAISED:
            return
        self._judge.ran(opt, "stepped")
        if saved is not None and not all_finite(held_tensors(by)):
            restore(by, saved)
            self.reverted += 1
            self._judge.ran(opt, "reverted")

    def _evaluating_step(
        self,
        opt: torch.optim.Optimizer,
        inner: Callable[..., Any],
        closure: Callable[[], Any] | None,
        kwargs: dict[str, Any],
    ) -> Any:
        """An optimizer that runs its closure itself: step on a copy, check, put back if bad.

        It steps first (the closure is evaluated inside); then the weights go back to the copy
        while the judge decides (a root-cause replay must see the weights the step started
        from), and the step's result is put in again only when it may stand."""
        losses: list[Any] = []
        judge = self._judge

        def evaluate() -> Any:
            with torch.enable_grad():
                out = closure() if closure is not None else None
            losses.append(out)
            if len(losses) == 1:
                judge.first_evaluation(opt)  # the step as it started: measured once, here
            return out

        saved = snapshot(opt) if self.protects else None
        self.evaluating = opt
        try:
            result = inner(evaluate, **kwargs)
        finally:
            self.evaluating = None
        if saved is None:  # (watched only: the step stands as it ran)
            judge.judge(opt)
            judge.ran(opt, "stepped")
            return result
        tensors = [x for x in losses if isinstance(x, torch.Tensor) and x.numel() == 1]
        after = snapshot(opt) if all_finite(held_tensors(opt) + tensors) else None
        restore(opt, saved)
        decision = judge.judge(opt)  # on the first evaluation's numbers
        if decision.skip:
            self.skipped += 1
            judge.ran(opt, "skipped")
            return result
        judge.ran(opt, "stepped")
        if after is None:
            self.reverted += 1
            judge.ran(opt, "reverted")
        else:
            restore(opt, after)
        return result


_INSIDE = (StepGuard._decide, StepGuard._stepped)
# Compiled (torch's "compiling the optimizer"): the guard's Python runs between graphs.
_OUTSIDE = (outside_compile(StepGuard._decide), outside_compile(StepGuard._stepped))


def _scaler_whole(opt: torch.optim.Optimizer, kwargs: Mapping[str, Any]) -> None:
    """A skipped step of an optimizer that takes the grad scaler itself (torch's older
    contract: its step unscales and records the inf check): the check is made here, or the
    scaler's ``update`` finds none and raises."""
    scaler = kwargs.get("grad_scaler")
    states = getattr(scaler, "_per_optimizer_states", None)
    state = states.get(id(opt)) if isinstance(states, dict) else None
    if scaler is not None and getattr(state and state.get("stage"), "name", "READY") == "READY":
        scaler.unscale_(opt)


def _unwind(opt: torch.optim.Optimizer) -> None:
    """Take every uninstalled guard off the top of ``opt.step`` (down to a live wrapper, one
    that is not a guard's, or the class's own ``step``)."""
    while True:
        func = getattr(opt.__dict__.get("step"), "__func__", None)
        guard = getattr(func, "_stabilizer_guard", None)
        if guard is None or guard._generation == getattr(func, "_stabilizer_generation", None):
            return
        previous = getattr(func, "_stabilizer_previous", None)
        if previous is None:
            opt.__dict__.pop("step", None)
        else:
            opt.step = previous  # type: ignore[method-assign]
