"""`upcast_to_fp32`: norms and attention in fp32, same Parameters, fp32 outputs unchanged."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import Tensor, nn

from stabilizer.demo.model import CausalSelfAttention
from stabilizer.live.remedies import FP32LayerNorm, FP32RMSNorm, UpcastReport, upcast_to_fp32

from .helpers import (
    TINY,
    assert_same_optimizer_state,
    clone_state,
    parameter_ids,
    tiny_gpt,
    tokens,
    trained_gpt,
)

NORMS = ("blocks.0.ln_1", "blocks.0.ln_2", "blocks.1.ln_1", "blocks.1.ln_2", "ln_f")
ATTENTION = ("blocks.0.attn", "blocks.1.attn")


class HandRMSNorm(nn.Module):
    """A hand-written RMSNorm that squares in its input's dtype, as many codebases do."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class ScaledLayerNorm(nn.LayerNorm):
    """A LayerNorm subclass with a forward of its own."""

    def forward(self, input: Tensor) -> Tensor:
        return 2.0 * super().forward(input)


class PlainLayerNorm(nn.LayerNorm):
    """A LayerNorm subclass that keeps nn.LayerNorm's forward."""


@pytest.mark.parametrize("attention", ["sdpa", "manual"])
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_fp32_outputs_unchanged_bit_for_bit(attention: str, norm: str) -> None:
    model, optimizer = trained_gpt(attention=attention, norm_position=norm)
    ids, state, keys = parameter_ids(model), clone_state(optimizer), list(model.state_dict())
    idx = tokens()
    with torch.no_grad():
        before, _ = model(idx)
        report = upcast_to_fp32(model)
        after, _ = model(idx)
    assert report == UpcastReport(NORMS, ATTENTION) and report.changed
    assert torch.equal(before, after)
    assert parameter_ids(model) == ids
    assert list(model.state_dict()) == keys
    assert_same_optimizer_state(optimizer, state)
    assert all(type(model.get_submodule(name)) is FP32LayerNorm for name in NORMS)
    assert all(model.get_submodule(name).softmax_fp32 for name in ATTENTION)


def test_idempotent() -> None:
    model = tiny_gpt()
    assert upcast_to_fp32(model).changed
    classes = [type(m) for m in model.modules()]
    again = upcast_to_fp32(model)
    assert again == UpcastReport() and not again.changed
    assert [type(m) for m in model.modules()] == classes


def test_overflowing_fp16_forward_becomes_finite() -> None:
    model = tiny_gpt(attention="manual")  # the hand-written path: scores formed in the input dtype
    n_embd = TINY["n_embd"]
    with torch.no_grad():
        for attn in model.modules():
            if isinstance(attn, CausalSelfAttention):
                attn.c_attn.bias[: 2 * n_embd] = 100.0  # q·k = 8 * 100 * 100 > 65504, fp16's max
    model.half()  # 16-true: weights and activations in fp16, no autocast
    ids = parameter_ids(model)
    with torch.no_grad():
        assert not torch.isfinite(model(tokens())[0]).all()
        upcast_to_fp32(model)
        logits, _ = model(tokens())
    assert torch.isfinite(logits).all() and logits.dtype == torch.float16
    assert parameter_ids(model) == ids


def test_hand_written_rms_norm_stops_overflowing_in_fp16() -> None:
    norm = HandRMSNorm(8)
    x = torch.linspace(-300.0, 300.0, 16).view(2, 8)  # 300² = 90000 > 65504: inf in fp16
    expected = norm(x)
    norm.half()
    weight = norm.weight
    broken = norm(x.half()).float()
    assert not torch.allclose(broken, expected, atol=0.01)
    assert upcast_to_fp32(norm) == UpcastReport(norms=("",))
    out = norm(x.half())
    assert out.dtype == torch.float16 and norm.weight is weight
    torch.testing.assert_close(out.float(), expected, atol=0.01, rtol=0.01)
    assert isinstance(norm, HandRMSNorm) and type(norm).__name__ == "FP32HandRMSNorm"


@pytest.mark.skipif(FP32RMSNorm is None, reason="nn.RMSNorm needs torch >= 2.4")
def test_torch_rms_norm() -> None:
    norm = nn.RMSNorm(8)
    x = torch.randn(3, 8) * 50.0
    before = norm(x)
    upcast_to_fp32(norm)
    assert type(norm) is FP32RMSNorm
    assert torch.equal(norm(x), before)  # fp32: unchanged bit for bit
    norm.half()
    out = norm(x.half())
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), before, atol=0.01, rtol=0.01)


@pytest.mark.parametrize("cls", [ScaledLayerNorm, PlainLayerNorm], ids=["own_forward", "inherited"])
def test_layer_norm_subclasses_keep_their_behavior(cls: type[nn.LayerNorm]) -> None:
    norm = cls(8)
    x = torch.randn(3, 8)
    before = norm(x)
    upcast_to_fp32(norm)
    assert isinstance(norm, cls) and type(norm) is not cls
    assert torch.equal(norm(x), before)
    norm.half()
    out = norm(x.half())
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), before, atol=0.01, rtol=0.01)


def test_layer_norm_without_bias_and_any_softmax_fp32_switch() -> None:
    model = nn.Sequential(nn.LayerNorm(4, bias=False), nn.Linear(4, 4))
    model[1].softmax_fp32 = False  # any module exposing the documented switch
    assert upcast_to_fp32(model) == UpcastReport(norms=("0",), attention=("1",))
    assert model[1].softmax_fp32 is True
    assert model(torch.randn(2, 4)).shape == (2, 4)


def test_upcast_model_copies_and_saves() -> None:
    model = tiny_gpt()
    upcast_to_fp32(model)
    idx = tokens()
    clone = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)  # FP32LayerNorm is importable, so the whole model pickles
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        assert torch.equal(clone(idx)[0], model(idx)[0])
        assert torch.equal(loaded(idx)[0], model(idx)[0])
