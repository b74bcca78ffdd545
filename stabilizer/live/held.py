"""`HeldNonFinite`: the NaN/Inf a model holds by design, so that only a change is judged.

A model may hold non-finite values before it trains, on purpose: the causal mask of
``nn.Transformer.generate_square_subsequent_mask`` kept as a buffer (``-inf`` above the
diagonal), the observers of ``torch.ao.quantization`` (min ``+inf``, max ``-inf`` until the first
batch), a running maximum that starts at ``-inf``, an unused parameter made with ``torch.empty``.
None of that is corruption. The guard's promise is about change: no step it lets through turns a
finite value non-finite. So each tensor is learned when it is first seen (at the first batch, or
when a parameter or buffer appears later): where it holds NaN/Inf then, those positions are
*held*, said once, and never judged; every other value is judged as before. A held position that
becomes finite (an observer that saw its first batch) is judged from then on.

Tensors that held no NaN/Inf when first seen (nearly all) cost nothing here: the checks skip
this class entirely while it holds nothing. Torch only.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .tensors import all_finite

__all__ = ["Held", "HeldNonFinite"]


@dataclass(frozen=True)
class Held:
    """A tensor that held NaN/Inf when it was first seen.

    Args:
        name: ``parameter blocks.0.mask``, ``buffer causal_mask`` ...
        count: How many of its values were non-finite.
        total: How many values it has.
        sample: What they were (``-inf``, ``nan``, ``+inf and -inf`` ...).
    """

    name: str
    count: int
    total: int
    sample: str


class HeldNonFinite:
    """The positions each tensor held as NaN/Inf when first seen; counts only new ones.

    Tensors are keyed by the caller: a parameter or an optimizer-state tensor by its identity,
    a buffer by its module and name (a buffer reassigned to a new tensor of the same shape keeps
    its held positions).
    """

    def __init__(self) -> None:
        # key -> bool mask of the held positions; empty while the model holds nothing by design
        # (nearly always), and then a caller may skip this class entirely, as the checks do
        self.masks: dict[Hashable, Tensor] = {}
        self._by_id: dict[int, tuple[weakref.ref[Tensor], Hashable]] = {}
        self._seen: set[Hashable] = set()

    def __bool__(self) -> bool:
        return bool(self.masks)

    def learn(self, named: Iterable[tuple[Hashable, str, Tensor]]) -> list[Held]:
        """Learn the tensors never seen before (an exact check: one host sync per dtype), and
        say which of them hold NaN/Inf. A key seen before is not looked at again."""
        unseen: dict[Hashable, tuple[str, Tensor]] = {}
        for key, name, t in named:
            if key not in self._seen:
                unseen.setdefault(key, (name, t))  # the first name given wins
        new = [(k, n, t) for k, (n, t) in unseen.items()]
        self._seen.update(unseen)
        if not new or all_finite(t for _, _, t in new):
            return []
        found = []
        for key, name, t in new:
            if not t.is_floating_point() or all_finite([t]):
                continue
            with torch.no_grad():
                mask = ~torch.isfinite(t.detach())
            self.masks[key] = mask
            self._by_id[id(t)] = (weakref.ref(t), key)
            found.append(Held(name, int(mask.sum()), t.numel(), _sample(t.detach()[mask])))
        return found

    def key_of(self, t: Tensor) -> Hashable | None:
        """The key `t` was learned under, when it holds positions (identity-checked)."""
        entry = self._by_id.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def split(
        self, tensors: Sequence[Tensor], keys: Sequence[Hashable] | None = None
    ) -> tuple[list[Tensor], list[tuple[Tensor, Tensor]]]:
        """The tensors judged whole, and ``(tensor, held mask)`` for those holding positions.

        Args:
            tensors: The tensors to check.
            keys: Their keys (buffers); by default each tensor's identity.
        """
        if not self.masks:
            return list(tensors), []
        whole, partial = [], []
        for i, t in enumerate(tensors):
            key = keys[i] if keys is not None else self.key_of(t)
            mask = self.masks.get(key) if key is not None else None
            if mask is None or mask.shape != t.shape:
                whole.append(t)
            else:
                partial.append((t, mask))
        return whole, partial

    def count_new(self, partial: Sequence[tuple[Tensor, Tensor]], device: torch.device) -> Tensor:
        """How many tensors hold NaN/Inf outside their held positions (a float32 scalar on
        `device`, nothing waits). Held positions that became finite are judged from now on."""
        total = torch.zeros((), dtype=torch.float32, device=device)
        with torch.no_grad():
            for t, mask in partial:
                bad = ~torch.isfinite(t.detach())
                total = total + (bad & ~mask).any().to(device, torch.float32)
                mask &= bad  # a held position that is finite now is held no longer
        return total

    def changed(self, tensors: Sequence[Tensor], keys: Sequence[Hashable] | None = None) -> bool:
        """Whether any tensor holds NaN/Inf outside its held positions (waits for the device)."""
        whole, partial = self.split(tensors, keys)
        if not all_finite(whole):
            return True
        device = partial[0][0].device if partial else torch.device("cpu")
        return bool(self.count_new(partial, device) > 0) if partial else False


def _sample(values: Tensor) -> str:
    """What the non-finite values are: ``-inf``, ``nan``, ``+inf and -inf`` ..."""
    kinds = []
    if bool(torch.isnan(values).any()):
        kinds.append("NaN")
    if bool((values == torch.inf).any()):
        kinds.append("+inf")
    if bool((values == -torch.inf).any()):
        kinds.append("-inf")
    return " and ".join(kinds)
