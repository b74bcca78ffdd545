"""`Carried`: a backward that no optimizer step took yet — accumulating, or abandoned?

A block that backpropagated and stepped nothing leaves its gradients behind. Whether they are
part of the next optimizer step is not a matter of how the loop is written (Lightning's manual
optimization steps every N batches; a plain loop ``continue``s past a NaN) but of the gradients
themselves: they are carried into the next step exactly when the tensors the optimizers will
read are still the ones that backward accumulated into, and nothing but later backwards wrote
them. ``zero_grad()`` (``set_to_none=True``, torch's default) replaces them with None, so the
next backward makes new ones; ``zero_grad(set_to_none=False)`` writes them in place, one write
more than the backwards since (each accumulates in place once), as torch's version counter
(``_version``) shows. Either way the block's loss, its verdict and its micro-batches do not
belong to the next step: it was abandoned. Its marks are weak: a mark keeps no gradient alive.
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
        backwards: The backwards run so far (the block's included).
    """

    def __init__(self, params: Iterable[torch.Tensor], backwards: int) -> None:
        self.backwards = backwards
        self._marks = [
            (weakref.ref(p), weakref.ref(p.grad), p.grad._version)
            for p in params
            if p.grad is not None
        ]

    def zeroed(self, backwards: int) -> bool:
        """Whether the marked gradients were let go or written since, other than by the
        `backwards` since (counted as `backwards` is): the carried block was abandoned."""
        since = backwards - self.backwards
        for param, grad, version in self._marks:
            p, g = param(), grad()
            if p is None:
                continue  # (a parameter that is gone takes no step)
            if g is None or p.grad is not g or g._version - version > since:
                return True
        return False
