"""`Carried`: a backward that no optimizer step took yet — accumulating, or abandoned?

A block that backpropagated and stepped nothing leaves its gradients behind. Whether they are
part of the next optimizer step is not a matter of how the loop is written (Lightning's manual
optimization steps every N batches; a plain loop ``continue``s past a NaN) but of the gradients
themselves: they are carried into the next step exactly when, as the next backward is about to
accumulate into them (or the next step opens, without one), the tensors the optimizers read are
still the ones that block's backward left, unwritten since. ``zero_grad()``
(``set_to_none=True``, torch's default) replaces them with None; ``zero_grad(set_to_none=False)``
writes them in place, which torch's version counter (``_version``) shows. Either way the block's
loss, its verdict and its micro-batches do not belong to the next step: it was abandoned. Its
marks are weak: a mark keeps no gradient alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

__all__ = ["Carried"]


class Carried:
    """The gradients a block left behind, marked when it ended.

    Args:
        params: The tensors the optimizers update.
        step: The host's step when it ended.
    """

    def __init__(self, params: Iterable[torch.Tensor], step: int) -> None:
        self.step = step
        self._marks = [
            (weakref.ref(p), weakref.ref(p.grad), p.grad._version)
            for p in params
            if p.grad is not None
        ]

    def zeroed(self) -> bool:
        """Whether the marked gradients were let go or written since: the block was
        abandoned (asked before anything else may write them: a backward, a step)."""
        for param, grad, version in self._marks:
            p, g = param(), grad()
            if p is None:
                continue  # (a parameter that is gone takes no step)
            if g is None or p.grad is not g or g._version != version:
                return True
        return False
