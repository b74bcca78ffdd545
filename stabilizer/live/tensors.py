"""Tensor checks the probes, the guard and the root cause share: norms that cannot overflow,
finiteness of any dtype, the tensors an optimizer holds, and a step's numbers on their way to
the host (`HostCopy`: the step's one host read).

Every check here is exact for every dtype: fp16, bf16, fp32 and fp64, complex (its real and
imaginary parts), sparse (its stored values). Nothing here waits for the device unless its name
says so (`all_finite` returns a Python bool, `host_norms` Python floats of CPU tensors,
`HostCopy.read` waits for its copy; the rest return device tensors). A step's pass over its
tensors is one ``_foreach_norm`` per dtype and one reduction, never a Python loop of kernels: on
the CPU, where ``_foreach_norm`` is such a loop inside torch, the small tensors are joined into
one first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar, cast

import torch
from torch import Tensor
from torch._utils import _flatten_dense_tensors

__all__ = [
    "CPU_READ",
    "HOST_READ",
    "HostCopy",
    "all_finite",
    "count_nonfinite",
    "count_suspect",
    "held_tensors",
    "host_norms",
    "l2_norms",
    "optimizer_state_tensors",
    "outside_compile",
    "stored_values",
    "wide_dtype",
]

_F = TypeVar("_F", bound=Callable[..., Any])

HOST_READ = "stabilizer::host_read"  # the profiler's name for a step's one planned host read
CPU_READ = "stabilizer::cpu_read"  # the profiler's name for the CPU path's read of its norms
_SMALL = 4096  # elements: on the CPU, tensors this small are joined into one for the fast test
_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_F32 = frozenset({torch.float16, torch.bfloat16, torch.float32})  # norms taken in float32
_LOW = frozenset({torch.float16, torch.bfloat16})


def wide_dtype(device: torch.device) -> torch.dtype:
    """float64 where the device computes it (Apple's MPS does not): a step's numbers carried in
    float32 would turn a finite 1e39 (a 64-true run's loss, a huge gradient norm) into Inf."""
    return torch.float32 if device.type == "mps" else torch.float64


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
        if t.dtype in _FLOATS and t.layout == torch.strided:  # the common case, in two reads
            if t.numel() > 0:
                yield t
        elif (t.is_floating_point() or t.is_complex()) and t.numel() > 0:
            yield _real(t)


def l2_norms(grads: Sequence[Tensor], device: torch.device) -> Tensor:
    """Each tensor's L2 norm as float64 on `device`: ``(len(grads),)``, one kernel per dtype.

    Never overflows, so a finite tensor always has a finite norm (a gradient of 1e20 squares to
    1e40, which float32 cannot hold): the norm is non-finite exactly when the tensor holds a NaN
    or an Inf. On an accelerator the squares are accumulated in float64 (an fp64 tensor is
    scaled by its largest magnitude first). On the CPU, where float64 arithmetic costs ~3x, the
    norms are taken in float32 and read at once (`host_norms`).
    """
    with torch.no_grad():
        real = list(_checkable(grads))
        if real and len(real) == len(grads) and _alike(real):  # one dtype, one device: usual
            return _norms(real, real[0].dtype, real[0].is_cpu).to(device)
        real = [_real(g) for g in grads]
        by_dtype: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, g in enumerate(real):
            by_dtype.setdefault((g.dtype, g.device), []).append(i)
        parts = [
            (idx, _norms([real[i] for i in idx], dtype, where.type == "cpu").to(device))
            for (dtype, where), idx in by_dtype.items()
        ]
    if len(parts) == 1:
        return parts[0][1]
    out = torch.zeros(len(real), dtype=torch.float64, device=device)
    for idx, norms in parts:
        out[idx] = norms
    return out


def _alike(ts: list[Tensor]) -> bool:
    dtype, device = ts[0].dtype, ts[0].device
    return all(t.dtype == dtype and t.device == device for t in ts)


def _norms(ts: list[Tensor], dtype: torch.dtype, cpu: bool) -> Tensor:
    if cpu:
        return torch.tensor(_host_grad_norms(ts, [])[0], dtype=torch.float64)
    if dtype == torch.float64:
        return torch.stack([_scaled_norm(t) for t in ts])
    return torch.stack(torch._foreach_norm(ts, dtype=torch.float64))


def host_norms(
    grads: Sequence[Tensor], check: Iterable[Tensor] = ()
) -> tuple[list[float], bool] | None:
    """On the CPU, in one pass: each gradient's L2 norm as a Python float (as `l2_norms`), and
    whether the fast test of `check` (`count_suspect`) found anything.

    One ``_foreach_norm`` over the gradients and the checked tensors of their dtype, one read
    (a CPU tensor's values: nothing waits). None unless every gradient is a non-empty floating
    CPU tensor and all share one dtype: then `l2_norms` and `count_suspect`.
    """
    with torch.no_grad():
        real = list(_checkable(grads))
        if not (real and len(real) == len(grads) and _alike(real) and real[0].is_cpu):
            return None
        return _host_grad_norms(real, _test_groups(check, real[0].device))


def _host_grad_norms(real: list[Tensor], groups: list[list[Tensor]]) -> tuple[list[float], bool]:
    """`host_norms` of checkable CPU gradients of one dtype and the fast test's `groups`. The
    few gradient norms that are not finite (a NaN, an Inf, or squares beyond float32) are taken
    again in float64; an fp64 gradient's is scaled by its peak instead."""
    dtype, n = real[0].dtype, len(real)
    joint = next((g for g in groups if g[0].dtype == dtype), []) if dtype in _F32 else []
    if dtype in _F32:  # with the checked tensors of the same dtype: one call
        norms = list(torch._foreach_norm([*real, *joint], dtype=torch.float32))
    else:
        norms = [_scaled_norm(t) for t in real]
    norms += [x for g in groups if g is not joint for x in _test_norms(g)]
    with torch.profiler.record_function(CPU_READ):  # a CPU tensor's values: nothing waits
        values: list[float] = torch.stack(norms).tolist()
    grad_norms, tested = values[:n], values[n:]
    bad = [i for i, v in enumerate(grad_norms) if not math.isfinite(v)]
    if bad and dtype in _F32:
        again = torch._foreach_norm([real[i] for i in bad], dtype=torch.float64)
        for i, norm in zip(bad, torch.stack(again).tolist(), strict=True):
            grad_norms[i] = norm
    return grad_norms, not all(map(math.isfinite, tested))


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
    with torch.no_grad():
        groups = [torch._foreach_norm(ts, ord=math.inf) for ts in _by_dtype(tensors, device)]
        norms = [n for group in groups for n in group]
        if not norms:
            return torch.zeros((), dtype=torch.float32, device=device)
        return (~torch.isfinite(torch.stack(norms))).sum().float()


def count_suspect(tensors: Iterable[Tensor], device: torch.device) -> Tensor:
    """A fast test for `count_nonfinite`: a float32 scalar on `device` that is 0 when every
    tensor is finite and its squares fit float32 (values below ~1e19), above 0 otherwise — not a
    count. A caller confirms a positive answer exactly (`all_finite`, `count_nonfinite`: the rare
    case). One float32 L2 norm per tensor (several times faster than the max-abs norm on a CPU),
    one ``_foreach_norm`` per dtype, one reduction. Tensors on another device are left out."""
    with torch.no_grad():
        norms = [x for g in _test_groups(tensors, device) for x in _test_norms(g)]
        if not norms:
            return torch.zeros((), dtype=torch.float32, device=device)
        return (~torch.isfinite(torch.stack(norms).sum())).float()


def _test_groups(tensors: Iterable[Tensor], device: torch.device) -> list[list[Tensor]]:
    """The fast test's tensors on `device`, one list per dtype. On the CPU the small ones
    (biases, norms' weights, Adam's step counters) are joined into one (`_join_small`): there
    ``_foreach_norm`` is a loop over its tensors, so the cost is then the bytes, not the count."""
    cpu = device.type == "cpu"
    groups: dict[torch.dtype, tuple[list[Tensor], list[Tensor]]] = {}
    for t in _checkable(tensors):
        if t.device == device:
            whole, small = groups.setdefault(t.dtype, ([], []))
            (small if cpu and t.numel() <= _SMALL else whole).append(t)
    return [[*whole, _join_small(small)] if small else whole for whole, small in groups.values()]


def _test_norms(ts: list[Tensor]) -> tuple[Tensor, ...]:
    """Float32 L2 norms of same-dtype tensors (fp16's 65504 caps no norm: float32 sums)."""
    return torch._foreach_norm(ts, dtype=torch.float32 if ts[0].dtype in _LOW else None)


def _join_small(ts: Sequence[Tensor]) -> Tensor:
    """One 1-D copy of same-dtype tensors in at most three C++ calls, whatever their number:
    the 0-d ones (Adam's step counters) stacked, the 1-d ones (biases, norms' weights) joined as
    they are, the others flattened."""
    by_dim: tuple[list[Tensor], list[Tensor], list[Tensor]] = ([], [], [])
    for t in ts:
        by_dim[min(t.dim(), 2)].append(t)
    scalars, parts, rest = by_dim
    if scalars:
        parts.insert(0, torch.stack(scalars))
    if rest:
        parts.append(_flatten_dense_tensors(rest))  # type: ignore[no-untyped-call]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _by_dtype(tensors: Iterable[Tensor], device: torch.device) -> list[list[Tensor]]:
    """The checkable tensors on `device`, grouped by dtype (one kernel each)."""
    groups: dict[torch.dtype, list[Tensor]] = {}
    for t in _checkable(tensors):
        if t.device == device:
            groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


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


def held_tensors(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """What an optimizer step writes: its parameters and its state tensors, as they are now."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return [*params, *optimizer_state_tensors(optimizer)]


class HostCopy:
    """One step's numbers on their way to the host, without making the step wait.

    On a GPU: one non-blocking copy into pinned host memory and an event behind it; `read` waits
    for that event only (the kernels queued after the copy keep running). On the CPU the numbers
    are already on the host.

    Args:
        numbers: A 1-D float32 tensor on any device.
    """

    def __init__(self, numbers: Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        self._values: list[float] | None = None
        self.waited = 0.0  # seconds `read` waited for the device
        self.on_device = numbers.is_cuda  # from an accelerator: the copy may still be under way
        if numbers.is_cuda:
            self._host = torch.empty(numbers.shape, dtype=numbers.dtype, pin_memory=True)
            self._host.copy_(numbers, non_blocking=True)
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record()
        else:
            self._host = numbers

    def read(self) -> list[float]:
        """The numbers as Python floats: the one host read of a step (waits for the copy)."""
        if self._values is None:
            # Named, so that a profile tells the planned read from any other (tests/test_profiler).
            with torch.profiler.record_function(HOST_READ):
                if self._event is not None:
                    start = time.perf_counter()
                    self._event.synchronize()
                    self.waited = time.perf_counter() - start
                self._values = self._host.tolist()
        return self._values


def outside_compile(hook: _F) -> _F:
    """`hook` (one the monitor puts on the user's modules) run as Python under ``torch.compile``:
    a graph break around it, never traced (its bookkeeping is not traceable, and traced it would
    compile the monitor's own code into the user's graph)."""
    return cast(_F, torch.compiler.disable(hook))  # type: ignore[no-untyped-call]
