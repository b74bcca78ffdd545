"""What a run holds, and how two runs' tensors compare: bit for bit, NaN equal to NaN."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

__all__ = ["differences", "held", "nonfinite_names", "same"]


def held(module: nn.Module, trainer: pl.Trainer) -> dict[str, Tensor]:
    """Every tensor a run holds, by name: parameters, buffers (persistent or not), optimizer
    state. Tied parameters appear under each name."""
    named = {f"param {n}": p for n, p in module.named_parameters(remove_duplicate=False)}
    named |= {f"buffer {n}": b for n, b in module.named_buffers(remove_duplicate=False)}
    names = {id(p): n for n, p in module.named_parameters()}
    for i, opt in enumerate(trainer.optimizers):
        for p, state in opt.state.items():
            for key, value in state.items():
                if isinstance(value, Tensor):
                    named[f"optimizer{i} {names.get(id(p), '?')}.{key}"] = value
    return {name: t.detach().clone() for name, t in named.items()}


def same(a: Tensor, b: Tensor) -> bool:
    """Bit-identical values, where NaN equals NaN (tensors that hold NaN by design)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    na, nb = a.isnan(), b.isnan()
    return torch.equal(na, nb) and torch.equal(a[~na], b[~nb])


def differences(a: dict[str, Tensor], b: dict[str, Tensor], limit: int = 4) -> list[str]:
    """The tensors that differ between two runs' `held` tensors (each with its largest gap),
    then those only one run holds."""
    out = []
    for name in (n for n in a if n in b and not same(a[n], b[n])):
        x, y = a[name], b[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            out.append(f"{name}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}")
            continue
        gap = (x.double() - y.double()).abs().nan_to_num(math.inf).max().item()
        out.append(f"{name}: max |difference| {gap:.3g}")
    out += [f"{n}: only in the first run" for n in a if n not in b]
    out += [f"{n}: only in the second run" for n in b if n not in a]
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


def nonfinite_names(tensors: dict[str, Tensor]) -> set[str]:
    """The names of the tensors that hold any NaN/Inf."""
    return {
        n for n, t in tensors.items()
        if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all())
    }  # fmt: skip
