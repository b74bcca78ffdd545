"""Depth groups of parameter names, and the block-group helpers of `stabilizer.core.signals`."""

from __future__ import annotations

import pytest

from stabilizer.core.groups import depth_group, group_params
from stabilizer.core.signals import block_group, block_index, group_key, strip_prefix

CONVENTIONS = [
    # (convention, parameter name, group)
    ("nanogpt-block", "blocks.3.attn.c_attn.weight", "block_03"),
    ("nanogpt-wte", "wte.weight", "embed"),
    ("nanogpt-wpe", "wpe.weight", "embed"),
    ("nanogpt-ln_f", "ln_f.weight", "head"),
    ("nanogpt-lm_head", "lm_head.weight", "head"),
    ("gpt2-h", "transformer.h.11.mlp.c_fc.weight", "block_11"),
    ("gpt2-wte", "transformer.wte.weight", "embed"),
    ("gpt2-ln_f", "transformer.ln_f.bias", "head"),
    ("llama-layers", "model.layers.7.self_attn.q_proj.weight", "block_07"),
    ("llama-embed_tokens", "model.embed_tokens.weight", "embed"),
    ("llama-norm", "model.norm.weight", "head"),
    ("llama-original-output", "output.weight", "head"),
    ("llama-original-tok_embeddings", "tok_embeddings.weight", "embed"),
    ("neox-layers", "gpt_neox.layers.0.attention.dense.weight", "block_00"),
    ("neox-embed_in", "gpt_neox.embed_in.weight", "embed"),
    ("neox-final_layer_norm", "gpt_neox.final_layer_norm.weight", "head"),
    ("neox-embed_out", "embed_out.weight", "head"),
    ("bert-layer", "bert.encoder.layer.5.attention.self.query.weight", "block_05"),
    ("bert-embeddings", "bert.embeddings.word_embeddings.weight", "embed"),
    ("bert-embeddings-norm", "bert.embeddings.LayerNorm.weight", "embed"),
    ("bert-pooler", "bert.pooler.dense.weight", "other"),
    ("torch-encoder", "encoder.layers.2.linear1.weight", "block_02"),
    ("torch-decoder", "decoder.layers.4.multihead_attn.in_proj_weight", "block_04"),
    ("torch-encoder-norm", "encoder.norm.weight", "head"),
    ("transformer-layers", "transformer.layers.9.norm1.weight", "block_09"),
    ("opt-decoder", "model.decoder.layers.1.fc1.weight", "block_01"),
    ("opt-embed_positions", "model.decoder.embed_positions.weight", "embed"),
    ("opt-final_layer_norm", "model.decoder.final_layer_norm.weight", "head"),
    ("t5-block", "encoder.block.3.layer.0.SelfAttention.q.weight", "block_03"),
    ("mingpt-tok_emb", "tok_emb.weight", "embed"),
    ("mingpt-pos_emb", "pos_emb", "embed"),
    ("mingpt-head", "head.weight", "head"),
    ("timm-patch_embed", "patch_embed.proj.weight", "embed"),
    ("timm-pos_embed", "pos_embed", "embed"),
    ("transformer-lens-unembed", "unembed.W_U", "head"),
    ("ddp-prefix", "module.blocks.0.mlp.c_fc.weight", "block_00"),
    ("compile-prefix", "_orig_mod.transformer.h.1.ln_1.weight", "block_01"),
    ("lightning-prefix", "model.blocks.2.attn.c_proj.weight", "block_02"),
    ("block-without-suffix", "blocks.4", "block_04"),
    ("block-norm-is-a-block", "layers.3.norm.weight", "block_03"),
    ("short-emb", "emb.weight", "embed"),
    ("short-tok", "tok.weight", "embed"),
    ("short-pos", "pos.weight", "embed"),
    ("short-token_emb", "token_emb.weight", "embed"),
    ("short-emb_ln", "emb_ln.weight", "embed"),
    ("final-ln", "ln.weight", "head"),
    ("final-ln-nested", "model.ln.bias", "head"),
    ("final-norm_f", "backbone.norm_f.weight", "head"),
    ("block-ln-is-a-block", "blocks.1.ln.weight", "block_01"),
    ("pos-part-of-a-name", "attn_pos_bias", "other"),
    ("other", "cls_token", "other"),
    ("other-nested", "adapter.down.weight", "other"),
    ("not-a-block-number", "blocks.x.weight", "other"),
]


@pytest.mark.parametrize(
    ("name", "group"), [c[1:] for c in CONVENTIONS], ids=[c[0] for c in CONVENTIONS]
)
def test_depth_group_conventions(name: str, group: str) -> None:
    assert depth_group(name) == group


def test_depth_group_pads_for_deep_stacks() -> None:
    assert depth_group("layers.7.mlp.weight", n_layers=120) == "block_007"


def test_depth_group_block_beyond_n_layers() -> None:
    with pytest.raises(ValueError, match=r"`index` must be < n_layers \(12\), got 12"):
        depth_group("layers.12.mlp.weight", n_layers=12)


def test_group_params_orders_embed_blocks_head_other() -> None:
    names = [
        "lm_head.weight",
        "blocks.10.mlp.weight",
        "adapter.weight",
        "blocks.2.attn.weight",
        "wte.weight",
        "blocks.2.mlp.weight",
        "ln_f.weight",
        "wpe.weight",
    ]
    assert group_params(names) == {
        "embed": ["wte.weight", "wpe.weight"],
        "block_02": ["blocks.2.attn.weight", "blocks.2.mlp.weight"],
        "block_10": ["blocks.10.mlp.weight"],
        "head": ["lm_head.weight", "ln_f.weight"],
        "other": ["adapter.weight"],
    }


def test_group_params_pads_to_the_deepest_block_and_takes_iterators() -> None:
    groups = group_params(f"layers.{i}.w" for i in range(100))
    assert list(groups)[:2] == ["block_000", "block_001"]
    assert list(groups)[-1] == "block_099"
    assert group_params([]) == {}


@pytest.mark.parametrize(
    ("index", "n_layers", "name"),
    [(0, None, "block_00"), (7, 12, "block_07"), (99, 100, "block_099"), (123, None, "block_123")],
    ids=["first", "twelve", "hundred-layers", "no-n_layers"],
)
def test_block_group(index: int, n_layers: int | None, name: str) -> None:
    assert block_group(index, n_layers) == name
    assert block_index(name) == index


def test_block_group_negative_index() -> None:
    with pytest.raises(ValueError, match="`index` must be >= 0, got -1"):
        block_group(-1)


@pytest.mark.parametrize(
    ("group", "index"),
    [("block_07", 7), ("grad_norm/block_12", 12), ("embed", None), ("block_", None)],
    ids=["group", "key", "embed", "no-digits"],
)
def test_block_index(group: str, index: int | None) -> None:
    assert block_index(group) == index


def test_group_key_and_strip_prefix() -> None:
    assert group_key("block_03") == "grad_norm/block_03"
    assert group_key("head", "update_ratio/") == "update_ratio/head"
    assert strip_prefix("stability/grad_norm/block_03") == "grad_norm/block_03"
    assert strip_prefix("loss") == "loss"
