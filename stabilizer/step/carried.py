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

Within a block the same holds (`let_go`): backwards whose gradients were all let go before the
block's next backward (SAM's ``first_step(zero_grad=True)``, before its base optimizer steps on
the second pass's gradients) are no part of the coming step, nor are their losses.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

from .host import MicroBatch

__all__ = ["Carried", "let_go"]


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


def let_go(
    micro: list[MicroBatch], losses: list[torch.Tensor]
) -> tuple[list[MicroBatch], list[torch.Tensor]]:
    """The block's micro-batches and losses once `losses` (backpropagated since the last step
    opened, their gradients let go since) are no part of the coming step: the micro-batches
    that made only those go too; the one now starting (the last) stays."""
    gone = {id(loss) for loss in losses}
    kept = [m for m in micro[:-1] if not m.losses or not {id(x) for x in m.losses} <= gone]
    return kept + micro[-1:], []
