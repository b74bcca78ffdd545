"""`swap_to_pre_ln`: post-LN blocks become pre-LN, keeping their Parameters."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from stabilizer.live.remedies import SwapReport, swap_to_pre_ln

from .helpers import assert_same_optimizer_state, clone_state, parameter_ids, tokens, trained_gpt

D_MODEL, N_HEAD = 16, 2


@pytest.fixture
def fastpath() -> Iterator[None]:
    enabled = torch.backends.mha.get_fastpath_enabled()
    yield
    torch.backends.mha.set_fastpath_enabled(enabled)


def encoder(norm_first: bool, norm: nn.LayerNorm | None = None) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        D_MODEL, N_HEAD, dim_feedforward=32, dropout=0.0, batch_first=True, norm_first=norm_first
    )
    # Built post-LN with nested tensors on, as PyTorch does by default: the fast path is armed.
    return nn.TransformerEncoder(layer, num_layers=2, norm=norm, enable_nested_tensor=True)


def test_reference_gpt_post_to_pre_keeps_parameters_and_optimizer_state() -> None:
    model, optimizer = trained_gpt(norm_position="post")
    ids, state = parameter_ids(model), clone_state(optimizer)
    idx = tokens()
    with torch.no_grad():
        post, _ = model(idx)
        report = swap_to_pre_ln(model)
        pre, _ = model(idx)
    assert report == SwapReport(blocks=("blocks.0", "blocks.1")) and report.changed
    assert report.new_parameters == ()  # ln_f exists already and now runs
    assert model.final_norm
    assert all(block.norm_position == "pre" for block in model.blocks)
    assert not torch.allclose(post, pre)
    assert parameter_ids(model) == ids
    assert_same_optimizer_state(optimizer, state)


def test_idempotent_and_a_no_op_on_pre_ln() -> None:
    model, _ = trained_gpt(norm_position="pre")
    idx = tokens()
    with torch.no_grad():
        before, _ = model(idx)
        report = swap_to_pre_ln(model)
        after, _ = model(idx)
    assert report == SwapReport() and not report.changed
    assert torch.equal(before, after)
    swapped, _ = trained_gpt(norm_position="post")
    assert swap_to_pre_ln(swapped).changed
    assert swap_to_pre_ln(swapped) == SwapReport()


def test_encoder_layers_flip_and_get_a_final_norm(fastpath: None) -> None:
    model = encoder(norm_first=False)
    old = list(model.parameters())
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 5, D_MODEL)).sum().backward()
    optimizer.step()
    state = clone_state(optimizer)
    report = swap_to_pre_ln(model)
    assert report.blocks == ("layers.0", "layers.1") and report.added_norms == ("norm",)
    assert all(layer.norm_first for layer in model.layers)
    assert isinstance(model.norm, nn.LayerNorm)
    assert list(report.new_parameters) == list(model.norm.parameters())
    assert all(a is b for a, b in zip(old, model.parameters(), strict=False))  # new ones last
    assert_same_optimizer_state(optimizer, state)
    optimizer.add_param_group({"params": list(report.new_parameters)})  # what the report is for
    x = torch.randn(2, 5, D_MODEL)
    model.train()
    model(x).sum().backward()
    optimizer.step()
    assert model.norm.weight.grad is not None
    # Eval with a padding mask is where PyTorch takes its fused fast path and nested tensors.
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    model.eval()
    with torch.no_grad():
        fast = model(x, src_key_padding_mask=padding)
        torch.backends.mha.set_fastpath_enabled(False)
        slow = model(x, src_key_padding_mask=padding)
    assert torch.isfinite(fast[:, :3]).all()
    torch.testing.assert_close(fast[0], slow[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast[1, :3], slow[1, :3], atol=1e-5, rtol=1e-5)
    assert swap_to_pre_ln(model) == SwapReport()


def test_encoder_with_a_final_norm_gets_no_new_one() -> None:
    norm = nn.LayerNorm(D_MODEL)
    model = encoder(norm_first=False, norm=norm)
    report = swap_to_pre_ln(model)
    assert report.added_norms == () and report.new_parameters == () and model.norm is norm


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
def test_pre_ln_encoder_without_final_norm_is_left_alone() -> None:
    model = encoder(norm_first=True)
    assert swap_to_pre_ln(model) == SwapReport() and model.norm is None


def test_decoder_and_full_transformer() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(D_MODEL, N_HEAD, 32, dropout=0.0, batch_first=True)
    decoder = nn.Sequential()
    decoder.add_module("dec", nn.TransformerDecoder(layer, num_layers=2))
    report = swap_to_pre_ln(decoder)
    assert report.blocks == ("dec.layers.0", "dec.layers.1")
    assert report.added_norms == ("dec.norm",) and len(report.new_parameters) == 2
    tgt, memory = torch.randn(2, 4, D_MODEL), torch.randn(2, 6, D_MODEL)
    for train in (True, False):
        decoder.train(train)
        assert torch.isfinite(decoder.dec(tgt, memory)).all()
    full = nn.Transformer(D_MODEL, N_HEAD, 1, 1, 32, dropout=0.0, batch_first=True)
    report = swap_to_pre_ln(full)  # nn.Transformer has final norms already
    assert report.blocks == ("encoder.layers.0", "decoder.layers.0") and report.added_norms == ()
    full.eval()
    assert torch.isfinite(full(torch.randn(2, 6, D_MODEL), tgt)).all()
