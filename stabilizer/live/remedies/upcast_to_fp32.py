"""`upcast_to_fp32`: normalization layers and attention softmax compute in fp32.

fp16 overflows above 65504: a squared activation of 256 already does, and attention scores QKᵀ/√d
of large queries and keys do too. Under ``torch.autocast`` softmax and layer_norm already run in
fp32, so this remedy matters for pure low-precision training (``.half()``, Lightning's
``"16-true"``/``"bf16-true"``), fused or hand-written low-precision norms, and hand-written
attention. fairseq's ``Fp32LayerNorm`` pattern: the module's class is swapped in place, so the
Parameter objects, and with them the optimizer state, stay the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FP32LayerNorm", "FP32RMSNorm", "UpcastReport", "upcast_to_fp32"]

_RMS_NORM: type[nn.Module] | None = getattr(nn, "RMSNorm", None)  # torch >= 2.4


class _Upcast(nn.Module):
    """Marker base of every upcast class, so a second `upcast_to_fp32` leaves them alone."""


class FP32LayerNorm(_Upcast, nn.LayerNorm):
    """``nn.LayerNorm`` computed in fp32; the output has the input's dtype.

    Under autocast a bf16/fp16 input therefore gets a bf16/fp16 output, where autocast's own
    LayerNorm returns fp32; an fp32 input (the usual residual stream there) is unaffected.
    """

    def forward(self, input: Tensor) -> Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        out = F.layer_norm(input.float(), self.normalized_shape, weight, bias, self.eps)
        return out.to(input.dtype)


class _RMSNormFP32(_Upcast):
    """``nn.RMSNorm`` computed in fp32; the output has the input's dtype (torch >= 2.4)."""

    normalized_shape: tuple[int, ...]
    eps: float | None
    weight: nn.Parameter | None

    def forward(self, input: Tensor) -> Tensor:
        weight = None if self.weight is None else self.weight.float()
        out = F.rms_norm(input.float(), self.normalized_shape, weight, self.eps)
        return out.to(input.dtype)


# The class nn.RMSNorm layers are swapped to; None before torch 2.4, which has no nn.RMSNorm.
FP32RMSNorm: type[nn.Module] | None = None
if _RMS_NORM is not None:
    FP32RMSNorm = type("FP32RMSNorm", (_RMSNormFP32, _RMS_NORM), {"__module__": __name__})


class _UpcastInput(_Upcast):
    """Runs the module's own ``forward`` on an fp32 input (weights mix in as fp32 by promotion)."""

    def forward(self, input: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        out = cast(Tensor, super().forward(input.float(), *args, **kwargs))
        return out.to(input.dtype)


@dataclass(frozen=True)
class UpcastReport:
    """What `upcast_to_fp32` changed: module names (as in ``named_modules()``).

    Attributes:
        norms: Normalization layers now computing in fp32.
        attention: Attention modules whose ``softmax_fp32`` switch was turned on.
        unswitched: Attention modules with no such switch, left as they were: torch's
            ``nn.MultiheadAttention`` (``nn.TransformerEncoderLayer``'s, ``nn.Transformer``'s)
            computes its softmax in its weights' dtype still.
    """

    norms: tuple[str, ...] = ()
    attention: tuple[str, ...] = ()
    unswitched: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        """Whether anything was changed."""
        return bool(self.norms or self.attention)

    @property
    def said(self) -> str:
        """What was changed, in words: only that (an attention left as it was is said so)."""
        said = f"{len(self.norms)} norms"
        said += f" and {len(self.attention)} attention softmaxes" if self.attention else ""
        said += " now in fp32"
        if self.unswitched:
            more = ", ..." if len(self.unswitched) > 1 else ""
            said += (
                f"; {len(self.unswitched)} attention softmaxes left as they were "
                f"({self.unswitched[0]}{more}: torch's nn.MultiheadAttention has no fp32 switch)"
            )
        return said


# Original class -> the class it is swapped to; subclasses and hand-written RMSNorms join later.
_CLASSES: dict[type[nn.Module], type[nn.Module]] = {nn.LayerNorm: FP32LayerNorm}
if _RMS_NORM is not None and FP32RMSNorm is not None:
    _CLASSES[_RMS_NORM] = FP32RMSNorm


def _upcast_class(module: nn.Module) -> type[nn.Module] | None:
    """The class to swap `module` to, or None when it is not a norm this remedy knows."""
    cls = type(module)
    if isinstance(module, _Upcast):
        return None
    if cls in _CLASSES:
        return _CLASSES[cls]
    is_rms = _RMS_NORM is not None and isinstance(module, _RMS_NORM)
    named_rms = cls.__name__.endswith("RMSNorm") and hasattr(module, "weight")
    if not (isinstance(module, nn.LayerNorm) or is_rms or (named_rms and hasattr(module, "eps"))):
        return None
    # The module's own forward runs on an fp32 input; for a subclass of a torch norm, whatever it
    # inherits from that norm resolves to the fp32 version placed after it.
    bases: tuple[type[nn.Module], ...] = (_UpcastInput, cls)
    if isinstance(module, nn.LayerNorm):
        bases = (_UpcastInput, cls, FP32LayerNorm)
    elif is_rms and FP32RMSNorm is not None:
        bases = (_UpcastInput, cls, FP32RMSNorm)
    upcast = type(f"FP32{cls.__name__}", bases, {"__module__": __name__})
    _CLASSES[cls] = upcast
    return upcast


def upcast_to_fp32(model: nn.Module) -> UpcastReport:
    """Make every normalization layer and switchable attention of `model` compute in fp32.

    Norms: each ``nn.LayerNorm``, ``nn.RMSNorm``, and module whose class name ends in ``RMSNorm``
    and that has ``weight`` and ``eps``, gets its class swapped for a subclass that upcasts the
    input (and weight/bias) to fp32 and casts the output back to the input's dtype. Attention:
    any module with a boolean ``softmax_fp32`` attribute (the reference ``CausalSelfAttention``)
    gets it set, so scores QKᵀ/√d and softmax run in fp32.

    torch's ``nn.MultiheadAttention`` has no switch: it is left as it is and named in the
    report's ``unswitched``.

    Idempotent; parameters, buffers and ``state_dict`` keys are untouched, and in fp32 the
    outputs are bit-for-bit the same. The swapped class of a subclass or hand-written RMSNorm is
    made at run time: pickle ``state_dict()``, not the whole model.

    Args:
        model: Any module; changed in place.
    """
    norms: list[str] = []
    attention: list[str] = []
    unswitched: list[str] = []
    for name, module in model.named_modules():
        upcast = _upcast_class(module)
        if upcast is not None:
            module.__class__ = upcast
            norms.append(name)
        if getattr(module, "softmax_fp32", None) is False:
            module.softmax_fp32 = True
            attention.append(name)
        elif isinstance(module, nn.MultiheadAttention):
            unswitched.append(name)
    return UpcastReport(tuple(norms), tuple(attention), tuple(unswitched))
