"""Tensor checks the probes, the guard and the root cause share: norms that cannot overflow,
finiteness of any dtype, the tensors an optimizer holds.

Every check here is exact for every dtype: fp16, bf16, fp32 and fp64, complex (its real and
imaginary parts), sparse (its stored values). Nothing here waits for the device unless its name
says so (`all_finite` returns a Python bool; the rest return device tensors).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import Tensor

__all__ = [
    "all_finite",
    "count_nonfinite",
    "count_suspect",
    "l2_norms",
    "optimizer_state_tensors",
    "stored_values",
]


def stored_values(t: Tensor) -> Tensor:
    """The values a tensor stores: itself when dense, its values when sparse (COO, CSR ...)."""
    if t.layout == torch.sparse_coo:
        return t.coalesce().values()
    if t.layout != torch.strided:
        return t.values()
    return t


def _real(t: Tensor) -> Tensor:
    """A dense real view (under ``no_grad``): complex as (re, im) pairs, sparse as its values."""
    t = stored_values(t)
    return torch.view_as_real(t) if t.is_complex() else t


def _checkable(tensors: Iterable[Tensor]) -> Iterator[Tensor]:
    for t in tensors:
        if (t.is_floating_point() or t.is_complex()) and t.numel() > 0:
            yield _real(t)


def l2_norms(grads: Sequence[Tensor], device: torch.device) -> Tensor:
    """Each tensor's L2 norm as float64 on `device`: ``(len(grads),)``, one kernel per dtype.

    Accumulated in float64, so a finite fp32/fp16/bf16 tensor always has a finite norm (a
    gradient of 1e20 squares to 1e40, which float32 cannot hold): the norm is non-finite exactly
    when the tensor holds a NaN or an Inf. An fp64 tensor is scaled by its largest magnitude
    first, for the same guarantee.
    """
    with torch.no_grad():
        real = [_real(g) for g in grads]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, g in enumerate(real):
            by_dtype.setdefault(g.dtype, []).append(i)
        norms: list[Tensor] = [torch.empty(())] * len(real)
        for dtype, idx in by_dtype.items():
            ts = [real[i] for i in idx]
            if dtype == torch.float64:
                found = [_scaled_norm(t) for t in ts]
            else:
                found = list(torch._foreach_norm(ts, dtype=torch.float64))
            for i, norm in zip(idx, found, strict=True):
                norms[i] = norm if norm.device == device else norm.to(device)
    return torch.stack(norms) if norms else torch.zeros(0, dtype=torch.float64, device=device)


def _scaled_norm(t: Tensor) -> Tensor:
    peak = t.abs().amax()
    safe = torch.where(torch.isfinite(peak) & (peak > 0), peak, torch.ones_like(peak))
    norm: Tensor = torch.linalg.vector_norm(t / safe) * torch.where(peak > 0, safe, peak)
    return norm


def count_nonfinite(tensors: Iterable[Tensor], device: torch.device) -> Tensor:
    """How many of the tensors hold a NaN or an Inf, as a float32 scalar on `device`.

    Tensors on another device (Adam's step counters live on the CPU beside CUDA parameters) are
    left out, so that the count never waits for a copy; integer tensors cannot be non-finite.
    Uses the max-abs norm, which cannot overflow.
    """
    return _count_nonfinite_norms(tensors, device, math.inf)


def count_suspect(tensors: Iterable[Tensor], device: torch.device) -> Tensor:
    """A fast upper bound of `count_nonfinite`: the tensors whose float32 L2 norm is not finite
    — every tensor holding a NaN or an Inf, and any whose squares overflow float32 (values
    beyond ~1e19). Several times faster than the max-abs norm on a CPU; a caller confirms a
    count above 0 with `all_finite` (the rare case)."""
    return _count_nonfinite_norms(tensors, device, 2.0)


def _count_nonfinite_norms(tensors: Iterable[Tensor], device: torch.device, ord: float) -> Tensor:
    with torch.no_grad():
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for t in _checkable(tensors):
            if t.device == device:
                by_dtype.setdefault(t.dtype, []).append(t)
        count = torch.zeros((), dtype=torch.float32, device=device)
        for ts in by_dtype.values():
            norms = torch.stack(torch._foreach_norm(ts, ord=ord))
            count = count + (~torch.isfinite(norms)).sum().float()
    return count


def all_finite(tensors: Iterable[Tensor]) -> bool:
    """Whether every element of every floating or complex tensor is finite (waits for the
    device: one host sync per device and dtype). Integer and empty tensors are skipped."""
    with torch.no_grad():
        by_key: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for t in _checkable(tensors):
            by_key.setdefault((t.device, t.dtype), []).append(t)
        flags = [
            torch.stack(torch._foreach_norm(ts, ord=math.inf)).isfinite().all().cpu()
            for ts in by_key.values()
        ]
    return all(bool(f) for f in flags)


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    """Every tensor held in ``optimizer.state`` (moments, step counts, ...), one level deep."""
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, Tensor):
                yield value
            elif isinstance(value, list | tuple):
                yield from (v for v in value if isinstance(v, Tensor))
