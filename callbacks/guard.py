"""``StepGuard``: skip an optimizer step so that the optimizer never sees it.

Zeroing the gradients is not skipping: AdamW would still apply momentum and weight decay, and
move every parameter. The guard wraps each optimizer's ``step`` (an instance attribute, removed
again by `uninstall`) so that a step the monitor condemned returns before the optimizer runs:
parameters and optimizer state (moments, step counters) stay exactly as they were.

Lightning calls ``optimizer.step(closure=...)`` (32-true, bf16, 16-true): the closure runs the
training step, the backward and ``on_before_optimizer_step`` (where the monitor decides), and
only then does the guard let the real step run, closure-free. With an fp16 grad scaler Lightning
runs the closure itself and ``GradScaler.step`` calls ``optimizer.step()`` only when the
gradients are finite: the scaler already skips those steps, and the guard never sees them.

With low-precision parameters (``16-true``, ``bf16-true``) the optimizer's own arithmetic can
overflow (AdamW's ``eps`` of 1e-8 is 0 in fp16) even from finite gradients. There the guard
copies parameters and optimizer state before the step and puts them back when the step left
anything non-finite (`verify`); the copy costs one pass over the weights and the state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from stabilizer.core.signals import GRAD_NORM, LOSS, NONFINITE_GRADS
from stabilizer.live.rootcause import all_finite, optimizer_state_tensors

__all__ = ["BAD_GRADS", "BAD_LOSS", "STEPPING_PAST", "UNCHECKED", "StepGuard", "decide"]

_LOW = (torch.float16, torch.bfloat16)

# Why `decide` skips a step.
BAD_LOSS = "non-finite loss"
BAD_GRADS = "non-finite gradients"
UNCHECKED = "the step could not be measured"
STEPPING_PAST = "stepping past bad data after a rollback"


def decide(
    values: Mapping[str, float], *, scaled: bool = False, stepping_past: bool = False
) -> tuple[bool, str]:
    """Skip the coming optimizer step or not, and why: a pure function of the step's numbers.

    Args:
        values: The step's ``loss``, ``grad_norm`` and ``nonfinite_grads``; empty when they
            could not be measured (then the step is skipped: nothing unchecked gets through).
        scaled: An fp16 grad scaler runs; non-finite gradients are its to skip (it never calls
            the optimizer then), a non-finite loss with finite gradients is not.
        stepping_past: Policy ``auto`` is stepping past the bad data after a rollback.

    Returns:
        ``(skip, reason)``: the reason is empty when the step goes ahead.
    """
    if not all(key in values for key in (LOSS, GRAD_NORM, NONFINITE_GRADS)):
        return True, UNCHECKED
    if not math.isfinite(values[LOSS]):
        return True, BAD_LOSS
    if not scaled and (not math.isfinite(values[GRAD_NORM]) or values[NONFINITE_GRADS] > 0):
        return True, BAD_GRADS
    if stepping_past:
        return True, STEPPING_PAST
    return False, ""


class StepGuard:
    """Wraps the ``step`` of optimizers; `skip` condemns the coming step.

    Args:
        verify: Check (and undo) each step's result: ``True``, ``False``, or ``None`` for "when
            any parameter is fp16/bf16".
    """

    def __init__(self, verify: bool | None = None) -> None:
        self.verify = verify
        self.skip = False  # set by the monitor before the step, cleared before the next
        self.skipped = 0  # steps the guard skipped
        self.reverted = 0  # steps whose non-finite result the guard undid
        self.last_reverted = False
        self._saved: list[tuple[torch.optim.Optimizer, Any]] = []

    def install(self, optimizers: list[torch.optim.Optimizer]) -> list[str]:
        """Wrap each optimizer's step; returns why some could not be (LBFGS re-runs closures)."""
        problems = []
        for opt in optimizers:
            if isinstance(opt, torch.optim.LBFGS):
                problems.append("LBFGS re-evaluates its closure: its steps cannot be skipped")
                continue
            verify = self.verify if self.verify is not None else _low_precision(opt)
            self._saved.append((opt, opt.__dict__.get("step")))
            opt.step = self._wrap(opt, opt.step, verify)  # type: ignore[method-assign]
        return problems

    def uninstall(self) -> None:
        """Put every optimizer's ``step`` back as it was."""
        for opt, previous in self._saved:
            if previous is None:
                opt.__dict__.pop("step", None)
            else:
                opt.step = previous  # type: ignore[method-assign]
        self._saved.clear()

    def _wrap(
        self, opt: torch.optim.Optimizer, step: Callable[..., Any], verify: bool
    ) -> Callable[..., Any]:
        def guarded_step(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()  # the monitor decides inside (on_before_optimizer_step)
            self.last_reverted = False
            if self.skip:
                self.skipped += 1
                return loss
            if not verify:
                step(**kwargs)
                return loss
            saved = _snapshot(opt)
            step(**kwargs)
            if not all_finite([*_params(opt), *optimizer_state_tensors(opt)]):
                _restore(opt, saved)
                self.reverted += 1
                self.last_reverted = True
            return loss

        # Keep the marks of wrappers below (torch's LR scheduler looks for its own on `step`).
        guarded_step.__dict__.update(getattr(step, "__dict__", {}))
        return guarded_step


def _params(opt: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for group in opt.param_groups:
        yield from group["params"]


_Snapshot = tuple[list[torch.Tensor], dict[torch.Tensor, dict[str, Any]]]


def _snapshot(opt: torch.optim.Optimizer) -> _Snapshot:
    params = [p.detach().clone() for p in _params(opt)]
    state = {
        p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for p, s in opt.state.items()
    }
    return params, state


def _restore(opt: torch.optim.Optimizer, saved: _Snapshot) -> None:
    """Parameters and state back in place (same tensor objects); state the step created goes."""
    params, state = saved
    with torch.no_grad():
        for p, copy in zip(_params(opt), params, strict=True):
            p.copy_(copy)
        for p in list(opt.state):
            if p not in state:
                del opt.state[p]
                continue
            for key, value in state[p].items():
                current = opt.state[p].get(key)
                if isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor):
                    current.copy_(value)
                else:
                    opt.state[p][key] = value


def _low_precision(opt: torch.optim.Optimizer) -> bool:
    return any(p.dtype in _LOW for group in opt.param_groups for p in group["params"])
