"""`weights_precision`: the precision of a run that did not name one, read from its weights.

A loop told no precision and running no grad scaler computes in its weights' dtype: a model
made ``.half()`` trains exactly as Lightning's ``"16-true"`` does, one loaded in bf16
(``torch_dtype=torch.bfloat16``, common for fine-tuning) as ``"bf16-true"``. Calling such a run
``"32-true"`` would be a false fact in its log header, and would keep the advice and remedies
that only 16-bit runs need (fp32 norms) from it. The dtype holding most of the parameters'
values decides (a LoRA adapter kept in fp32 beside a bf16 base computes in bf16).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["weights_precision"]

_NAMES = {torch.float16: "16-true", torch.bfloat16: "bf16-true", torch.float64: "64-true"}


def weights_precision(model: nn.Module) -> str:
    """Lightning's name for the precision `model`'s weights compute in (``"32-true"`` for
    fp32, and for a model with no floating-point parameter)."""
    values: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            values[p.dtype] = values.get(p.dtype, 0) + p.numel()
    if not values:
        return "32-true"
    return _NAMES.get(max(values, key=values.__getitem__), "32-true")
