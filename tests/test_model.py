"""Tests of the reference GPT: causality, path parity, init, training, KV cache, precision."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from stabilizer.demo.model import GPT, Block, CausalSelfAttention, GPTConfig, KVCache

TINY = {"vocab_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 16}

VARIANTS = list(itertools.product(("sdpa", "manual"), ("pre", "post"), ("learned", "rope")))
VARIANT_IDS = ["-".join(v) for v in VARIANTS]


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_gpt(seed: int = 0, **overrides: Any) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **overrides})).eval()


def attention_modules(model: GPT) -> list[CausalSelfAttention]:
    return [m for m in model.modules() if isinstance(m, CausalSelfAttention)]


def last_token_changed(idx: torch.Tensor, vocab_size: int) -> torch.Tensor:
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % vocab_size
    return changed


def earlier_logits_unchanged(model: GPT) -> bool:
    """The causal self-check: changing the last token must leave earlier positions' logits alone."""
    idx = torch.randint(0, TINY["vocab_size"], (2, TINY["block_size"]))
    with torch.no_grad():
        before, _ = model(idx)
        after, _ = model(last_token_changed(idx, TINY["vocab_size"]))
    assert not torch.allclose(before[:, -1], after[:, -1]), "the perturbation must show somewhere"
    return torch.allclose(before[:, :-1], after[:, :-1], atol=1e-5)


@pytest.mark.parametrize(("attention", "norm", "positions"), VARIANTS, ids=VARIANT_IDS)
def test_causal_self_check(attention: str, norm: str, positions: str) -> None:
    model = tiny_gpt(attention=attention, norm_position=norm, positions=positions)
    assert earlier_logits_unchanged(model)


def test_causal_self_check_catches_leaky_manual_mask() -> None:
    model = tiny_gpt(attention="manual")
    for attn in attention_modules(model):
        attn.mask.fill_(True)  # every position may attend to the future
    assert not earlier_logits_unchanged(model)


def test_causal_self_check_catches_leaky_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    sdpa = F.scaled_dot_product_attention

    def leaky(*args: Any, **kwargs: Any) -> torch.Tensor:
        return sdpa(*args, **{**kwargs, "is_causal": False})

    monkeypatch.setattr(F, "scaled_dot_product_attention", leaky)
    assert not earlier_logits_unchanged(tiny_gpt(attention="sdpa"))


@pytest.mark.parametrize("softmax_fp32", [False, True], ids=["softmax_native", "softmax_fp32"])
@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_sdpa_equals_manual(positions: str, softmax_fp32: bool) -> None:
    model = tiny_gpt(positions=positions, softmax_fp32=softmax_fp32)
    idx = torch.randint(0, TINY["vocab_size"], (2, TINY["block_size"]))
    with torch.no_grad():
        sdpa, _ = model(idx)
        for attn in attention_modules(model):
            attn.attention = "manual"  # switched at run time, same weights
        manual, _ = model(idx)
    torch.testing.assert_close(sdpa, manual, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_initial_loss_is_uniform(positions: str, norm: str) -> None:
    model = tiny_gpt(vocab_size=256, positions=positions, norm_position=norm)
    idx, targets = torch.randint(0, 256, (2, 8, 16))
    with torch.no_grad():
        _, loss = model(idx, targets)
    assert loss is not None
    assert loss.item() == pytest.approx(math.log(256), abs=0.1)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_blocks_train(norm: str) -> None:
    model = tiny_gpt(norm_position=norm).train()
    data = torch.arange(4 * 17).view(4, 17) % 7  # a repeating pattern
    x, y = data[:, :-1], data[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        _, loss = model(x, y)
        assert loss is not None
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("attention", ["sdpa", "manual"])
@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_cached_forward_equals_full_forward(positions: str, attention: str) -> None:
    model = tiny_gpt(positions=positions, attention=attention)
    idx = torch.randint(0, TINY["vocab_size"], (2, 12))
    cache = [KVCache() for _ in model.blocks]
    with torch.no_grad():
        full, _ = model(idx)
        pieces = [model(idx[:, :5], cache=cache)[0]]  # prefill several positions at once
        pieces += [model(idx[:, t : t + 1], cache=cache)[0] for t in range(5, 9)]
        pieces.append(model(idx[:, 9:], cache=cache)[0])  # several again, after a cache
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_generate_with_cache_equals_recomputation(positions: str) -> None:
    model = tiny_gpt(positions=positions)
    prompt = torch.randint(0, TINY["vocab_size"], (2, 5))
    # 5 + 20 tokens outgrow block_size 16, so the cached run also exercises the cropping fallback.
    cached = model.generate(prompt, 20, temperature=0.0, use_cache=True)
    recomputed = model.generate(prompt, 20, temperature=0.0, use_cache=False)
    assert cached.shape == (2, 25)
    assert torch.equal(cached[:, :5], prompt)
    assert torch.equal(cached, recomputed)
    top1 = model.generate(prompt, 20, top_k=1, use_cache=True)
    assert torch.equal(top1, cached)


def test_generate_sampling_is_reproducible_with_a_generator() -> None:
    model = tiny_gpt()
    prompt = torch.zeros(1, 1, dtype=torch.long)
    first = model.generate(prompt, 10, top_k=10, generator=torch.Generator().manual_seed(1))
    second = model.generate(prompt, 10, top_k=10, generator=torch.Generator().manual_seed(1))
    assert torch.equal(first, second)


@pytest.mark.parametrize("attention", ["sdpa", "manual"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_softmax_fp32_runs_in_low_precision(dtype: torch.dtype, attention: str) -> None:
    reference = tiny_gpt(softmax_fp32=True, attention=attention)
    idx = torch.randint(0, TINY["vocab_size"], (2, TINY["block_size"]))
    with torch.no_grad():
        expected, _ = reference(idx)
        logits, loss = reference.to(dtype)(idx, idx)
    assert logits.dtype == dtype
    assert loss is not None and loss.dtype == torch.float32
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits.float(), expected, atol=0.05, rtol=0.05)


def test_softmax_fp32_routes_sdpa_to_the_manual_path_in_low_precision() -> None:
    model = tiny_gpt(softmax_fp32=True).to(torch.bfloat16)
    idx = torch.randint(0, TINY["vocab_size"], (2, TINY["block_size"]))
    with torch.no_grad():
        sdpa, _ = model(idx)
        for attn in attention_modules(model):
            attn.attention = "manual"
        manual, _ = model(idx)
    assert torch.equal(sdpa, manual)


def test_softmax_fp32_switch_prevents_fp16_score_overflow() -> None:
    model = tiny_gpt(attention="manual")
    n_embd = TINY["n_embd"]
    with torch.no_grad():
        for attn in attention_modules(model):
            attn.c_attn.bias[: 2 * n_embd] = 100.0  # q·k = 8 * 100 * 100 > 65504, fp16's max
    model.to(torch.float16)
    idx = torch.randint(0, TINY["vocab_size"], (1, 8))
    with torch.no_grad():
        assert not torch.isfinite(model(idx)[0]).all()
        for attn in attention_modules(model):
            attn.softmax_fp32 = True  # the run-time switch a remedy flips
        assert torch.isfinite(model(idx)[0]).all()


def test_norm_position_switches_at_run_time_keeping_parameters() -> None:
    model = tiny_gpt(norm_position="post")
    params = list(model.parameters())
    idx = torch.randint(0, TINY["vocab_size"], (2, 8))
    assert not model.final_norm
    with torch.no_grad():
        post, _ = model(idx)
        for block in model.blocks:
            assert isinstance(block, Block)
            block.norm_position = "pre"
        pre, _ = model(idx)
    assert model.final_norm
    assert not torch.allclose(post, pre)
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))


def test_unknown_run_time_choice_raises() -> None:
    model = tiny_gpt()
    block = model.blocks[0]
    assert isinstance(block, Block)
    block.norm_position = "mid"  # type: ignore[assignment]
    with pytest.raises(ValueError, match="`norm_position` must be one of 'pre', 'post', got 'mid'"):
        model(torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"n_embd": 130}, "`n_embd` must be divisible by `n_head`, got n_embd=130, n_head=4"),
        ({"norm_position": "mid"}, "`norm_position` must be one of 'pre', 'post', got 'mid'"),
        ({"positions": "alibi"}, "`positions` must be one of 'learned', 'rope', got 'alibi'"),
        ({"attention": "flash"}, "`attention` must be one of 'sdpa', 'manual', got 'flash'"),
        ({"n_embd": 12, "n_head": 4, "positions": "rope"}, "must be even for rotary.*got 3"),
        ({"n_layer": 0}, "`n_layer` must be >= 1, got 0"),
        ({"dropout": 1.0}, r"`dropout` must be in \[0, 1\), got 1.0"),
    ],
    ids=["indivisible", "norm", "positions", "attention", "odd_rope", "no_layers", "dropout"],
)
def test_config_validation(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GPTConfig(**overrides)


def test_sequence_longer_than_block_size_raises() -> None:
    model = tiny_gpt(block_size=8)
    with pytest.raises(ValueError, match="sequence length 9 exceeds `block_size` 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_cache_of_the_wrong_length_raises() -> None:
    model = tiny_gpt()
    with pytest.raises(ValueError, match=r"`cache` must hold one KVCache per block \(2\), got 1"):
        model(torch.zeros(1, 4, dtype=torch.long), cache=[KVCache()])


def test_cached_sequence_longer_than_block_size_raises() -> None:
    model = tiny_gpt(block_size=8)
    cache = [KVCache() for _ in model.blocks]
    model(torch.zeros(1, 8, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="sequence length 9 exceeds `block_size` 8"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)


def test_generate_argument_validation() -> None:
    model = tiny_gpt()
    prompt = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="`max_new_tokens` must be >= 0, got -1"):
        model.generate(prompt, -1)
    with pytest.raises(ValueError, match=r"`temperature` must be >= 0, got -1\.0"):
        model.generate(prompt, 1, temperature=-1.0)
    with pytest.raises(ValueError, match="`top_k` must be >= 1 or None, got 0"):
        model.generate(prompt, 1, top_k=0)


def test_weight_tying_and_parameter_names() -> None:
    model = tiny_gpt()
    assert model.lm_head.weight is model.wte.weight
    names = [name for name, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names
    assert any(name.startswith("blocks.0.") for name in names)
    assert any(name.startswith(f"blocks.{TINY['n_layer'] - 1}.") for name in names)
    assert isinstance(model.blocks[1], Block)
    assert model.num_params() == sum(p.numel() for p in model.parameters())


def test_residual_projections_use_scaled_init() -> None:
    model = tiny_gpt(n_embd=64, n_layer=4)
    expected = 0.02 / math.sqrt(2 * 4)
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):
            assert p.std().item() == pytest.approx(expected, rel=0.1)
        elif name.endswith("bias"):
            assert torch.count_nonzero(p) == 0
