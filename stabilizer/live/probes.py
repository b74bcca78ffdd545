"""Probes: gather a step's signals from a model cheaply, on the device, as one tensor.

The probes never copy to the host themselves: the caller stacks their outputs and sends them to
the host in one `stabilizer.live.tensors.HostCopy` per step. Torch only; no Lightning.
"""

from __future__ import annotations

import logging
import math
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from stabilizer.core.groups import group_params
from stabilizer.core.signals import ACT_ABSMAX_PREFIX, GRAD_NORM, GRAD_NORM_PREFIX, NONFINITE_GRADS
from stabilizer.live.tensors import count_suspect, host_norms, l2_norms, outside_compile

__all__ = ["ActivationProbe", "GradProbe"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class GradProbe:
    """Total and per-depth-group L2 gradient norms, plus the count of non-finite gradients.

    Watches every tensor the optimizers will update (each param group's params: module
    parameters or not); each step, those that have a ``.grad``. A trainable parameter no
    optimizer holds (a teacher network, a head excluded from the optimizer) is not watched: its
    gradient never reaches the weights, so a NaN there skips nothing. Without optimizers (a
    probe built on a bare module) every trainable parameter is watched.
    The watched set is derived again whenever a param group is added or a parameter's
    ``requires_grad`` changes (a cheap check per call), so a backbone unfrozen mid-run is watched
    from its first gradient on.

    Groups come from parameter names (``blocks.N.``, ``layers.N.``, ``h.N.`` …, see
    :func:`stabilizer.core.groups.depth_group`) unless ``grouping`` maps a name to a group itself;
    an optimizer tensor that is no module parameter is in ``other``. Optimizer tensors that do not
    require grad count in the total and the non-finite count only. A group none of whose tensors
    has a gradient at a step (a module the forward never used: the final norm of a post-LN stack,
    a pooler an MLM loss ignores) gets no gradient, not a zero one: its key is in `gradless`
    after the call, and the monitor leaves it out of the step's record.

    The fast path is one ``torch._foreach_norm`` over all gradients and one ``index_add_`` into
    the groups. Where it cannot run (sparse gradients, an unusual dtype or device) the probe says
    so once and computes each norm on its own (the values of a sparse gradient): slower, exact.
    With sharded parameters (FSDP) the norms are of this rank's shards: see `sharded_squares`.

    Args:
        module: The model; its trainable parameters are watched and named.
        optimizers: The optimizers whose param groups are watched.
        grouping: ``name -> group`` to override the naming conventions.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        grouping: Callable[[str], str] | None = None,
    ) -> None:
        self._module, self._optimizers, self._grouping = module, list(optimizers), grouping
        # Each watched tensor, a weak reference to the gradient measured, and its version.
        self._marks: list[tuple[nn.Parameter, weakref.ref[Tensor] | None, int]] = []
        self.exact = False  # the fast path failed once: per-tensor norms from then on
        self._index: tuple[tuple[int, ...], Tensor] | None = None  # group indices, on the device
        self.gradless: set[str] = set()  # the group keys none of whose tensors had a gradient
        self._build()

    def __call__(self, check: Sequence[Tensor] | None = None) -> Tensor:
        """``(2 + n_groups,)`` float64 on the gradients' device, ordered as :attr:`keys`; with
        `check`, one value more past them: the weights' fast test of those tensors
        (`stabilizer.live.tensors.count_suspect`: 0 when all are finite), in the same pass.

        Norms never overflow, so a finite gradient never has a non-finite norm (see
        `stabilizer.live.tensors.l2_norms`): ``nonfinite_grads`` counts exactly the tensors
        that hold a NaN or an Inf.
        """
        grads, index = self._gather()
        if grads and grads[0].is_cpu and not self.exact:  # one pass, its values read at once
            found = self._fast(lambda: host_norms(grads, check or ()))
            if found is not None:
                values = self._sums(found[0], index)
                values += [float(found[1])] if check is not None else []
                return torch.tensor(values, dtype=torch.float64)
        out = self._device_norms(grads, index)
        if check is None:
            return out
        return torch.cat((out, count_suspect(check, out.device).to(out.dtype).view(1)))

    def _gather(self) -> tuple[list[Tensor], list[int]]:
        """The gradients of the watched tensors that have one, and their groups; notes which
        groups have none and what each gradient was (`untouched`)."""
        if self._signature() != self._seen:
            self._build()
        grads, index = [], []
        marks: list[tuple[nn.Parameter, weakref.ref[Tensor] | None, int]] = []
        for p, i in zip(self._tensors, self._group_idx, strict=True):
            g = p.grad
            if g is None:
                marks.append((p, None, -1))
                continue
            # A weak reference: the probe must not keep a step's gradients alive after it (with
            # `zero_grad(set_to_none=True)` that would be a second copy of them).
            marks.append((p, weakref.ref(g), g._version))
            # Sharded (FSDP2 DTensor) gradients: the local shard; the caller reduces.
            grads.append(g if type(g) is Tensor or not hasattr(g, "to_local") else g.to_local())
            index.append(i)
        self._marks = marks
        present = set(index)
        self.gradless = {k for i, k in enumerate(self.keys[2:]) if i not in present}
        return grads, index

    def _device_norms(self, grads: list[Tensor], index: list[int]) -> Tensor:
        """The norms as tensors on the gradients' device: nothing waits."""
        if not grads:  # nothing to update this step
            return torch.zeros(len(self.keys), device=self._device)
        device = grads[0].device
        norms = self._norms(grads, device)  # (n_grads,) float64
        # Summed as squares relative to the largest finite norm: a finite norm of 1e200 (a
        # 64-true run) squared would overflow even float64, and a finite gradient must never
        # get a non-finite norm.
        finite = torch.isfinite(norms)
        top = torch.where(finite, norms, 0.0).amax().clamp_min(torch.finfo(norms.dtype).tiny)
        # One bucket past the groups holds the tensors that are checked but not logged per group.
        sq = torch.zeros(len(self.groups) + 1, dtype=torch.float64, device=device)
        sq.index_add_(0, self._group_index(tuple(index), device), (norms / top).square())
        nonfinite = (~finite).sum().double()
        return torch.cat((sq.sum().sqrt().view(1) * top, nonfinite.view(1), sq[:-1].sqrt() * top))

    def _sums(self, norms: list[float], index: list[int]) -> list[float]:
        """The total norm, the non-finite count and each group's norm, from the tensors' (as
        squares relative to the largest finite norm, as `_device_norms` sums them)."""
        top = max((n for n in norms if math.isfinite(n)), default=0.0) or sys.float_info.min
        sq = [0.0] * (len(self.groups) + 1)
        for i, n in zip(index, norms, strict=True):
            ratio = n / top
            sq[i] += ratio * ratio
        total = math.sqrt(sum(sq)) * top
        nonfinite = sum(1.0 for n in norms if not math.isfinite(n))
        return [total, nonfinite, *(math.sqrt(v) * top for v in sq[:-1])]

    def forget(self) -> None:
        """Let go of the gradients the last call measured (`untouched` has nothing to compare
        until the next call): a step's gradients must not outlive it."""
        self._marks = []

    def untouched(self) -> bool:
        """Whether every watched gradient is the tensor the last call measured, unchanged since.

        Torch counts in-place writes in a tensor's ``_version``; a new ``.grad`` is a new
        object. A write through ``.data`` is not counted: see ``docs/protection.md``.
        """
        for p, ref, version in self._marks:
            g = p.grad
            if ref is None:
                if g is not None:
                    return False
            elif g is None or g is not ref() or g._version != version:
                return False
        return True

    @property
    def tensors(self) -> list[Tensor]:
        """The watched tensors (parameters and optimizer tensors), in a fixed order."""
        return list(self._tensors)

    def _signature(self) -> tuple[tuple[bool, ...], tuple[int, ...]]:
        grad_flags = tuple(p.requires_grad for p in self._module_params)
        sizes = tuple(len(g["params"]) for opt in self._optimizers for g in opt.param_groups)
        return grad_flags, sizes

    def _build(self) -> None:
        """Derive the watched tensors, their groups and the keys."""
        module_named = list(self._module.named_parameters())
        self._module_params = [p for _, p in module_named]
        stepped = [p for opt in self._optimizers for g in opt.param_groups for p in g["params"]]
        in_optimizer = {id(p) for p in stepped}
        named = [
            (n, p)
            for n, p in module_named
            if id(p) in in_optimizer or (p.requires_grad and not self._optimizers)
        ]
        known = {id(p) for p in self._module_params}
        extra = {id(p): p for p in stepped if id(p) not in known}  # not a module parameter
        named += [(f"optimizer_tensor_{i}", p) for i, p in enumerate(extra.values())]
        logged = [n for n, p in named if p.requires_grad]
        if self._grouping is None:
            group_of = {n: g for g, names in group_params(logged).items() for n in names}
        else:
            group_of = {n: self._grouping(n) for n in logged}
        self.groups = list(dict.fromkeys(group_of.values()))
        index = {g: i for i, g in enumerate(self.groups)}
        self._tensors = [p for _, p in named]
        # A frozen parameter held by an optimizer: checked, in the bucket past the groups.
        self._group_idx = [index[group_of[n]] if n in group_of else len(index) for n, _ in named]
        self.keys = [GRAD_NORM, NONFINITE_GRADS] + [GRAD_NORM_PREFIX + g for g in self.groups]
        self._device = self._tensors[0].device if self._tensors else torch.device("cpu")
        self._seen = self._signature()

    def _norms(self, grads: list[Tensor], device: torch.device) -> Tensor:
        found = self._fast(lambda: l2_norms(grads, device))
        if found is not None:
            return found
        return torch.cat([l2_norms([g], g.device).to(device) for g in grads])

    def _fast(self, norms: Callable[[], _T]) -> _T | None:
        """The fast path's `norms`; None, and the exact path from then on, where it cannot run
        on these gradients (said once)."""
        if self.exact:
            return None
        try:
            return norms()
        except (RuntimeError, NotImplementedError, TypeError) as e:
            self.exact = True
            log.warning(
                "gradient norms: the fast path cannot run on these gradients (%s); each "
                "gradient is now checked on its own: exact, slower",
                str(e).splitlines()[0][:120],
            )
            return None

    def _group_index(self, index: tuple[int, ...], device: torch.device) -> Tensor:
        # Built again only when the set of gradients changes: a host-to-device copy waits.
        if self._index is None or self._index[0] != index or self._index[1].device != device:
            self._index = (index, torch.tensor(index, device=device))
        return self._index[1]

    @staticmethod
    def sharded_squares(vec: Tensor) -> Tensor:
        """Norms → squares (counts unchanged), to sum over the ranks that hold the shards."""
        out = vec.square()
        out[1] = vec[1]
        return out

    @staticmethod
    def from_squares(vec: Tensor) -> Tensor:
        """The inverse of `sharded_squares`, after the sum over ranks."""
        out = vec.sqrt()
        out[1] = vec[1]
        return out


_MLP_NAMES = ("mlp", "ffn", "feed_forward", "feedforward", "linear2", "fc2")


class ActivationProbe:
    """Max |activation| of norm inputs, attention outputs and MLP outputs, on sampled steps.

    Forward hooks are attached only while :meth:`attach` is in force, so steps that are not
    sampled cost nothing. Modules are found by type and name: every ``*Norm*`` module (its input),
    every module whose class name contains ``Attention`` (its output), and every module whose
    last name component is an MLP name (``mlp``, ``ffn``, ``feed_forward``, ``linear2``, ``fc2``).
    Attention modules with a fused ``c_attn`` projection and ``n_head`` (the reference GPT,
    nanoGPT, GPT-2 style) also report their raw scores ``max |q·kᵀ|`` as ``<name>.scores``: in
    fp16 the scores product is where overflow usually starts (rotary positions are ignored there).

    Args:
        model: The model to watch.
    """

    def __init__(self, model: nn.Module) -> None:
        self._targets: list[tuple[str, nn.Module, bool]] = []  # (name, module, use input)
        self._scores: list[tuple[str, nn.Module, int]] = []  # (name, fused QKV Linear, n_head)
        for name, module in model.named_modules():
            kind = type(module).__name__
            if "Norm" in kind:
                self._targets.append((name, module, True))
            elif "Attention" in kind or name.rsplit(".", 1)[-1] in _MLP_NAMES:
                self._targets.append((name, module, False))
                qkv = getattr(module, "c_attn", None)
                if isinstance(qkv, nn.Module) and isinstance(getattr(module, "n_head", None), int):
                    self._scores.append((name + ".scores", qkv, module.n_head))
        names = [name for name, _, _ in self._targets] + [name for name, _, _ in self._scores]
        self.keys = [ACT_ABSMAX_PREFIX + name for name in names]
        self._values: dict[str, Tensor] = {}
        self._handles: list[Any] = []
        self.dropped: set[str] = set()  # keys whose hook raised once: not measured any more
        self.seconds = 0.0  # host time spent in the hooks (the monitor's cost)

    def attach(self) -> None:
        """Start recording (idempotent)."""
        if self._handles:
            return
        self._values.clear()
        for name, module, use_input in self._targets:
            hook = self._hook(ACT_ABSMAX_PREFIX + name, use_input)
            self._handles.append(module.register_forward_hook(hook))
        for name, qkv, n_head in self._scores:
            hook = self._scores_hook(ACT_ABSMAX_PREFIX + name, n_head)
            self._handles.append(qkv.register_forward_hook(hook))

    def detach(self) -> Tensor | None:
        """Stop recording; the maxima as ``(len(keys),)`` float32, or None if not recording.

        The maxima are handed over once: a step that is not sampled has none (they are not
        carried over from the last sampled step).
        """
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if not self._values:
            return None
        device = next(iter(self._values.values())).device
        nan = torch.full((), math.nan, device=device)
        out = torch.stack([self._values.get(k, nan) for k in self.keys])
        self._values.clear()
        return out

    def _hook(self, key: str, use_input: bool) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            x = args[0] if use_input and args else output
            if isinstance(x, tuple):  # e.g. nn.MultiheadAttention returns (output, weights)
                x = x[0]
            if isinstance(x, Tensor) and x.is_floating_point():
                self._keep(key, x.detach().abs().amax().float())

        return self._safe(key, record)

    def _scores_hook(self, key: str, n_head: int) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple[Any, ...], qkv: Tensor) -> None:
            B, T, C3 = qkv.shape  # a module that is not nanoGPT's raises here: `_safe` drops it
            C = C3 // 3
            q, k = qkv.detach()[..., :C], qkv.detach()[..., C : 2 * C]  # (B, T, C) each
            q = q.reshape(B, T, n_head, -1).transpose(1, 2)  # (B, nh, T, hs)
            k = k.reshape(B, T, n_head, -1).transpose(1, 2)  # (B, nh, T, hs)
            scores = q.float() @ k.float().transpose(-2, -1)  # (B, nh, T, T), in fp32: no overflow
            self._keep(key, scores.abs().amax())

        return self._safe(key, record)

    def _safe(self, key: str, record: Callable[..., None]) -> Callable[..., None]:
        """A hook that cannot break the user's forward: one that raises drops its signal for
        the rest of the run, with one warning; outside ``torch.compile``'s graph."""

        @outside_compile
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if key in self.dropped:
                return
            start = time.perf_counter()
            try:
                record(module, args, output)
            except Exception as e:
                self.dropped.add(key)
                self._values.pop(key, None)
                self.keys = [k for k in self.keys if k != key]
                log.warning("activation probe: %s dropped (%r)", key, e)
            self.seconds += time.perf_counter() - start

        return hook

    def _keep(self, key: str, value: Tensor) -> None:
        # Gradient accumulation runs several forwards per step: keep the largest.
        prev = self._values.get(key)
        self._values[key] = value if prev is None else torch.maximum(prev, value)
