"""Probes: gather a step's signals from a model cheaply, on the device, as one tensor.

The probes never copy to the host themselves: the caller stacks their outputs and pays a single
device-to-host copy per step. Torch only; no Lightning.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from stabilizer.core.groups import group_params
from stabilizer.core.signals import ACT_ABSMAX_PREFIX, GRAD_NORM, GRAD_NORM_PREFIX, NONFINITE_GRADS

__all__ = ["ActivationProbe", "GradProbe"]


class GradProbe:
    """Total and per-depth-group L2 gradient norms, plus the count of non-finite gradients.

    Groups come from parameter names (``blocks.N.``, ``layers.N.``, ``h.N.`` …, see
    :func:`stabilizer.core.groups.depth_group`) unless ``grouping`` maps a name to a group itself.
    One ``torch._foreach_norm`` over all gradients, one ``index_add_`` into the groups. With
    sharded parameters (FSDP) the norms are of this rank's shards: `reduce_sharded` combines them.

    Args:
        named_parameters: ``model.named_parameters()``; only those requiring grad are watched.
        grouping: ``name -> group`` to override the naming conventions.
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, nn.Parameter]],
        grouping: Callable[[str], str] | None = None,
    ) -> None:
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        if not named:
            raise ValueError("the model has no parameters that require gradients")
        if grouping is None:
            by_group = group_params(n for n, _ in named)
            group_of = {n: g for g, names in by_group.items() for n in names}
            self.groups = list(by_group)
        else:
            group_of = {n: grouping(n) for n, _ in named}
            self.groups = list(dict.fromkeys(group_of.values()))
        index = {g: i for i, g in enumerate(self.groups)}
        self._params = [p for _, p in named]
        self._group_idx = [index[group_of[n]] for n, _ in named]
        self._full_index: Tensor | None = None
        self.keys = [GRAD_NORM, NONFINITE_GRADS] + [GRAD_NORM_PREFIX + g for g in self.groups]

    def __call__(self) -> Tensor:
        """``(2 + n_groups,)`` float32 on the gradients' device, ordered as :attr:`keys`."""
        present = [(p.grad, i) for p, i in zip(self._params, self._group_idx, strict=True)]
        # Sharded (FSDP2 DTensor) gradients: the local shard; the caller reduces across ranks.
        grads = [g.to_local() if hasattr(g, "to_local") else g for g, _ in present if g is not None]
        if not grads:
            return torch.full((len(self.keys),), math.nan)
        device = grads[0].device
        norms = torch.stack(torch._foreach_norm(grads)).float()  # (n_params_with_grad,)
        index = self._index([i for g, i in present if g is not None], device)
        sq = torch.zeros(len(self.groups), device=device).index_add_(0, index, norms.square())
        nonfinite = (~torch.isfinite(norms)).sum().float()
        return torch.cat((sq.sum().sqrt().view(1), nonfinite.view(1), sq.sqrt()))

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

    def _index(self, idx: list[int], device: torch.device) -> Tensor:
        if len(idx) == len(self._group_idx):  # the usual case: every parameter has a gradient
            if self._full_index is None or self._full_index.device != device:
                self._full_index = torch.tensor(idx, device=device)
            return self._full_index
        return torch.tensor(idx, device=device)


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
        """Stop recording; the maxima as ``(len(keys),)`` float32, or None if nothing ran."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if not self._values:
            return None
        device = next(iter(self._values.values())).device
        nan = torch.tensor(math.nan, device=device)
        return torch.stack([self._values.get(k, nan) for k in self.keys])

    def _hook(self, key: str, use_input: bool) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            x = args[0] if use_input and args else output
            if isinstance(x, tuple):  # e.g. nn.MultiheadAttention returns (output, weights)
                x = x[0]
            if isinstance(x, Tensor) and x.is_floating_point():
                self._keep(key, x.detach().abs().amax().float())

        return record

    def _scores_hook(self, key: str, n_head: int) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple[Any, ...], qkv: Tensor) -> None:
            B, T, C3 = qkv.shape
            C = C3 // 3
            q, k = qkv.detach()[..., :C], qkv.detach()[..., C : 2 * C]  # (B, T, C) each
            q = q.reshape(B, T, n_head, -1).transpose(1, 2)  # (B, nh, T, hs)
            k = k.reshape(B, T, n_head, -1).transpose(1, 2)  # (B, nh, T, hs)
            scores = q.float() @ k.float().transpose(-2, -1)  # (B, nh, T, T), in fp32: no overflow
            self._keep(key, scores.abs().amax())

        return record

    def _keep(self, key: str, value: Tensor) -> None:
        # Gradient accumulation runs several forwards per step: keep the largest.
        prev = self._values.get(key)
        self._values[key] = value if prev is None else torch.maximum(prev, value)
