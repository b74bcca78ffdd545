"""Remedies: plain functions and classes that make a running training more stable.

Each works on any ``nn.Module``/optimizer without Lightning, keeps the existing Parameter objects
(so optimizer state survives), and returns what it changed, for a ``remedy_applied`` finding. The
Lightning callback decides *when* to apply them.

| remedy | what it changes |
|---|---|
| `clip_gradients` / `enable_gradient_clipping` | gradient norm capped (per call / per trainer) |
| `upcast_to_fp32` | norms and attention softmax computed in fp32 |
| `swap_to_pre_ln` | post-LN blocks switched to pre-LN |
| `LRMultiplier` | LR scaled or re-warmed on top of any scheduler |
| `Snapshots` | last good state restored (rollback) |
"""

from __future__ import annotations

from .clip_gradients import ClipReport, clip_gradients, clipped_norm, enable_gradient_clipping
from .lr_multiplier import FactorChange, LRMultiplier
from .rollback import RollbackError, Snapshots
from .skip_window import SkipWindow
from .swap_to_pre_ln import SwapReport, swap_to_pre_ln
from .upcast_to_fp32 import FP32LayerNorm, FP32RMSNorm, UpcastReport, upcast_to_fp32

__all__ = [
    "ClipReport",
    "FP32LayerNorm",
    "FP32RMSNorm",
    "FactorChange",
    "LRMultiplier",
    "RollbackError",
    "SkipWindow",
    "Snapshots",
    "SwapReport",
    "UpcastReport",
    "clip_gradients",
    "clipped_norm",
    "enable_gradient_clipping",
    "swap_to_pre_ln",
    "upcast_to_fp32",
]
