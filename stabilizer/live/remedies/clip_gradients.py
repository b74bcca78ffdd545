"""`clip_gradients`: rescale the gradients so their total norm is at most `max_norm`.

In Lightning the callback does not call this: it turns clipping on by setting
``trainer.gradient_clip_val = 1.0``, which Lightning re-reads every optimizer step (after unscaling
fp16 gradients), and records the change with `enable_gradient_clipping`. In a plain PyTorch loop,
call `clip_gradients` between ``backward()`` and ``optimizer.step()``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

__all__ = ["ClipReport", "clip_gradients", "clipped_norm", "enable_gradient_clipping"]

# torch.nn.utils.clip_grad_norm_ divides by (total_norm + 1e-6) so a zero norm cannot divide by 0.
_TORCH_EPS = 1e-6


@dataclass(frozen=True)
class ClipReport:
    """What turning gradient clipping on changed.

    Attributes:
        before: The clip threshold in force before (None: clipping was off).
        after: The clip threshold in force now.
    """

    before: float | None
    after: float

    @property
    def changed(self) -> bool:
        """Whether the threshold differs from the one before."""
        return self.before != self.after


class _ClipTarget(Protocol):
    """Anything holding a clip threshold read every step, such as a Lightning ``Trainer``."""

    gradient_clip_val: int | float | None


def clip_gradients(
    parameters: Tensor | Iterable[Tensor], max_norm: float = 1.0, norm_type: float = 2.0
) -> float:
    """Scale all gradients in place so that their joint norm is at most `max_norm`.

    A thin wrapper over ``torch.nn.utils.clip_grad_norm_`` (``foreach``, no error on a non-finite
    norm). With a NaN/Inf norm every gradient becomes NaN, as in torch: skip that step instead.

    Args:
        parameters: Parameters (or one tensor) whose ``.grad`` is clipped; ``None`` grads skipped.
        max_norm: Largest total norm allowed after clipping.
        norm_type: Order of the norm (``2.0``: Euclidean; ``math.inf``: largest entry).

    Returns:
        The total norm *before* clipping, the number to log.
    """
    if not max_norm > 0.0:
        raise ValueError(f"`max_norm` must be > 0, got {max_norm}")
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    if not any(p.grad is not None for p in params):
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(
        params, max_norm, norm_type=norm_type, error_if_nonfinite=False, foreach=True
    )
    return float(norm)


def clipped_norm(norm: float, max_norm: float) -> float:
    """The total norm after `clip_gradients` with `max_norm` brought it down from `norm`."""
    if not math.isfinite(norm):
        return math.nan
    return norm * min(1.0, max_norm / (norm + _TORCH_EPS))


def enable_gradient_clipping(target: _ClipTarget, max_norm: float = 1.0) -> ClipReport:
    """Set ``target.gradient_clip_val`` (e.g. a Lightning ``Trainer``) and report the change.

    A threshold already at or below `max_norm` is kept: the remedy never loosens clipping.

    Args:
        target: Object whose ``gradient_clip_val`` attribute the training loop reads every step.
        max_norm: Clip threshold to set.
    """
    if not max_norm > 0.0:
        raise ValueError(f"`max_norm` must be > 0, got {max_norm}")
    before = target.gradient_clip_val
    if before is not None and 0.0 < before <= max_norm:
        return ClipReport(float(before), float(before))
    target.gradient_clip_val = max_norm
    return ClipReport(None if before is None else float(before), float(max_norm))
