"""A step run on a copy: the optimizer's parameters and state copied before it, put back after.

`StepGuard` verifies a step whose own arithmetic can overflow from finite gradients (fp16/bf16
parameters, Adam-style ``eps=0``, a gradient so large that its square overflows), and every step
of an optimizer that evaluates its closure itself (LBFGS): `snapshot` before, `restore` when
what the step wrote is not finite. Only such steps pay for the copy.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

__all__ = ["Snapshot", "restore", "snapshot"]

Snapshot = tuple[list[torch.Tensor], dict[torch.Tensor, dict[str, Any]]]
"""The parameters (in the order of the param groups) and the state, copied."""


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def snapshot(opt: torch.optim.Optimizer) -> Snapshot:
    """`opt`'s parameters and state, copied."""
    params = [p.detach().clone() for p in _params(opt)]
    # A tensor is cloned (a deep copy of one costs several times more); the rest is copied
    # deep: LBFGS keeps lists of tensors (its history) that a step appends to in place.
    state = {p: {k: _copied(v) for k, v in s.items()} for p, s in opt.state.items()}
    return params, state


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and not value.requires_grad:
        return value.clone()
    return copy.deepcopy(value)


def restore(opt: torch.optim.Optimizer, saved: Snapshot) -> None:
    """Parameters and state back in place (same tensor objects where they still exist); state
    the step created goes, state it dropped comes back."""
    params, state = saved
    with torch.no_grad():
        for p, value in zip(_params(opt), params, strict=True):
            p.copy_(value)
        for p, kept in state.items():
            if p not in opt.state:
                opt.state[p] = copy.deepcopy(kept)
        for p in list(opt.state):
            if p not in state:
                del opt.state[p]
                continue
            for key, value in state[p].items():
                current = opt.state[p].get(key)
                if isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor):
                    current.copy_(value)
                else:
                    opt.state[p][key] = copy.deepcopy(value)
