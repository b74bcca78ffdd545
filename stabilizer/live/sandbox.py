"""`sandbox`: run a model's code (a root-cause replay, a preflight check) without changing the run.

Inside the sandbox the caller may run forwards and backwards of the model; when it ends, the
parameters' gradients (the same tensor objects), ``requires_grad`` flags, every buffer (values
and objects: BatchNorm's running statistics), the modules' own attributes (``self.calls += 1``,
``training``), the containers, random generators and iterators they hold
(`stabilizer.live.user_state.UserState`: a list a step appends to, a ``torch.Generator``, an
iterator drawn with ``next``) and every global random state (torch, CUDA, numpy, Python) are as
they were before.
Parameters are not copied (they would cost a model's worth of memory): a parameter that the code
inside wrote in place is named in `Sandboxed.changed`, so that the caller can say so. Keeping the
optimizers from stepping is the caller's part (the guard's ``inert`` mode). Torch only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .rng import RngState
from .user_state import UserState

__all__ = ["Sandboxed", "sandbox"]


@dataclass
class Sandboxed:
    """What a sandbox found when it ended.

    Args:
        changed: Parameters written in place inside the sandbox (not undone).
    """

    changed: list[str] = field(default_factory=list)


@contextmanager
def sandbox(model: nn.Module) -> Iterator[Sandboxed]:
    """Everything but the parameters' values is put back when the block ends (even on error)."""
    report = Sandboxed()
    rng = RngState.capture(everything=True)
    params = list(model.named_parameters())
    grads = [(p, p.grad, p.requires_grad, p._version) for _, p in params]
    modules = list(model.modules())
    attrs = [(m, dict(m.__dict__), dict(m._buffers)) for m in modules]
    buffers = [
        (b, b.detach().clone()) for m in modules for b in m._buffers.values() if b is not None
    ]
    user = UserState.capture(modules)  # (iterators get stand-ins: `attrs` holds the originals)
    for _, p in params:
        p.grad = None  # a backward inside would accumulate into the caller's gradients
    try:
        yield report
    finally:
        with torch.no_grad():
            for m, saved, saved_buffers in attrs:
                _restore_dict(m.__dict__, saved)
                _restore_dict(m._buffers, saved_buffers)
            user.restore()
            for b, copy in buffers:
                b.copy_(copy)
            for p, grad, flag, _ in grads:
                p.grad = grad
                p.requires_grad_(flag)
        rng.restore()
        report.changed = [
            name for (name, p), (_, _, _, v) in zip(params, grads, strict=True) if p._version != v
        ]


def _restore_dict(current: dict[str, Any], saved: dict[str, Any]) -> None:
    """Put the saved entries back into the same dict object (others hold a reference to it)."""
    if current.keys() == saved.keys() and all(current[k] is v for k, v in saved.items()):
        return  # the usual case: nothing was reassigned
    current.clear()
    current.update(saved)
