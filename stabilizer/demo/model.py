"""The reference model: a decoder-only GPT in one readable file, after nanoGPT.

Remedies switch knobs at run time and keep the same Parameters: ``CausalSelfAttention.softmax_fp32``
and ``.attention``, and ``Block.norm_position``, are plain attributes read on every forward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import AttentionImpl, GPTConfig, NormPosition, Softmax, check_choice

__all__ = ["GPT", "MLP", "Block", "CausalSelfAttention", "GPTConfig", "KVCache", "RotaryEmbedding"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass
class KVCache:
    """Keys and values one attention layer has computed, so generation feeds one token a step."""

    k: Tensor | None = None  # (B, nh, T_past, hs); None before the first forward
    v: Tensor | None = None  # (B, nh, T_past, hs)

    @property
    def length(self) -> int:
        """Number of positions held: the position offset of the next token."""
        return 0 if self.k is None else self.k.size(2)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add the new positions and return all keys and values, ``(B, nh, T_past + T, hs)``."""
        if self.k is not None and self.v is not None:
            k = torch.cat((self.k, k), dim=2)  # (B, nh, T_past + T, hs)
            v = torch.cat((self.v, v), dim=2)  # (B, nh, T_past + T, hs)
        self.k, self.v = k, v
        return k, v


class RotaryEmbedding(nn.Module):
    """Rotary positions (RoPE): rotate channel pairs ``(i, i + hs/2)`` by position-dependent angles.

    Args:
        head_size: Channels per head (even).
        block_size: Longest context; the cos/sin tables are computed once for it.
        base: Wavelength base of the lowest frequency.
    """

    cos: Tensor
    sin: Tensor

    def __init__(self, head_size: int, block_size: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = base ** -(torch.arange(0, head_size, 2).float() / head_size)  # (hs/2,)
        angles = torch.outer(torch.arange(block_size).float(), inv_freq)  # (block_size, hs/2)
        # Not persistent: derived from the config, so checkpoints stay free of them.
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        """Rotate ``x`` ``(B, nh, T, hs)`` whose first position is ``offset``."""
        T = x.size(-2)
        cos = self.cos[offset : offset + T].to(x.dtype)  # (T, hs/2)
        sin = self.sin[offset : offset + T].to(x.dtype)  # (T, hs/2)
        x1, x2 = x.chunk(2, dim=-1)  # (B, nh, T, hs/2) each
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, nh, T, hs)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection.

    The SDPA fast path and the plain path (scores, causal mask, softmax) compute the same thing.
    The plain one runs when ``attention == "manual"``, or when ``softmax_fp32`` is set and the
    input is fp16/bf16: SDPA cannot be told to form its scores in fp32.

    Args:
        config: Model configuration; seeds the attributes below.

    Attributes:
        attention: ``"sdpa"`` or ``"manual"``, read on every forward.
        softmax_fp32: Scores and softmax in fp32, read on every forward (``upcast_to_fp32``).
    """

    mask: Tensor

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.head_size = config.n_embd // config.n_head
        self.dropout = config.dropout
        self.attention: AttentionImpl = config.attention
        self.softmax_fp32: bool = config.softmax_fp32
        self.softmax: Softmax = config.softmax
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.rotary: RotaryEmbedding | None = None
        if config.positions == "rope":
            self.rotary = RotaryEmbedding(self.head_size, config.block_size)
        # Kept even on the SDPA path: `attention` can change at run time, and a cached decode
        # step needs a mask slice. True where query position i may attend to key position j <= i.
        causal = torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool))
        self.register_buffer("mask", causal, persistent=False)

    def forward(self, x: Tensor, cache: KVCache | None = None) -> Tensor:
        """Attend over ``x`` ``(B, T, C)`` (and the cached positions before it); same shape out."""
        B, T, C = x.size()
        past = 0 if cache is None else cache.length
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # (B, T, C) each
        q = q.view(B, T, self.n_head, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        if self.rotary is not None:
            q, k = self.rotary(q, past), self.rotary(k, past)
        if cache is not None:
            k, v = cache.append(k, v)  # (B, nh, past + T, hs)
        y = self._sdpa(q, k, v, past) if self._use_sdpa(x.dtype) else self._manual(q, k, v, past)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        return cast(Tensor, self.resid_dropout(self.c_proj(y)))

    def _use_sdpa(self, dtype: torch.dtype) -> bool:
        check_choice("attention", self.attention)
        if self.softmax == "naive":
            return False
        return self.attention == "sdpa" and not (self.softmax_fp32 and dtype in _LOW_PRECISION)

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, past: int) -> Tensor:
        dropout_p = self.dropout if self.training else 0.0
        if past == 0:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        # With a cache the queries are the *last* T of the keys; is_causal would align them with
        # the first T, so pass the matching rows of the mask instead.
        mask = self.mask[past : past + q.size(-2), : k.size(-2)]  # (T, past + T)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)

    def _manual(self, q: Tensor, k: Tensor, v: Tensor, past: int) -> Tensor:
        if self.softmax_fp32:
            # fp16 overflows above 65504: form the scores, not only the softmax, in fp32.
            q, k = q.float(), k.float()
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_size))  # (B, nh, T, past+T)
        mask = self.mask[past : past + q.size(-2), : k.size(-2)]  # (T, past + T)
        att = att.masked_fill(~mask, float("-inf"))
        att = _softmax(att, self.softmax).to(v.dtype)
        att = self.attn_dropout(att)
        y: Tensor = att @ v  # (B, nh, T, past + T) x (B, nh, past + T, hs) -> (B, nh, T, hs)
        return y


def _softmax(att: Tensor, how: Softmax) -> Tensor:
    """Softmax over the last dim: the library's, or hand-written without the max-subtraction
    (exp overflows above ~11.1 in fp16, ~88.7 in fp32: then inf / inf is NaN)."""
    if how == "naive":
        e = att.exp()
        return e / e.sum(dim=-1, keepdim=True)
    return F.softmax(att, dim=-1)


class MLP(nn.Module):
    """Position-wise feed-forward C -> 4C -> GELU -> C, sized by ``config``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Transform ``x`` ``(B, T, C)``; same shape out."""
        return cast(Tensor, self.dropout(self.c_proj(self.gelu(self.c_fc(x)))))


class Block(nn.Module):
    """One Transformer block: attention then MLP, each with a residual connection.

    Pre-LN normalizes each sublayer's input and leaves the residual stream alone; post-LN (2017)
    normalizes after each residual addition, which is harder to train deep.

    Args:
        config: Model configuration; seeds ``norm_position``.

    Attributes:
        norm_position: ``"pre"`` or ``"post"``, read on every forward (``swap_to_pre_ln``).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm_position: NormPosition = config.norm_position
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, cache: KVCache | None = None) -> Tensor:
        """Transform ``x`` ``(B, T, C)``; same shape out."""
        check_choice("norm_position", self.norm_position)
        if self.norm_position == "pre":
            x = x + self.attn(self.ln_1(x), cache)
            x = x + self.mlp(self.ln_2(x))
        else:
            x = self.ln_1(x + self.attn(x, cache))
            x = self.ln_2(x + self.mlp(x))
        return x


class GPT(nn.Module):
    """A decoder-only language model: embeddings, ``n_layer`` blocks, final norm, tied head.

    Parameters: ``wte``, ``wpe`` (learned positions only), ``blocks.<i>.*``, ``ln_f``; the head
    is tied to ``wte`` (GPT-2), so ``named_parameters()`` lists that matrix once, as ``wte.weight``.

    Args:
        config: Model configuration.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe: nn.Embedding | None = None
        if config.positions == "learned":
            self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one matrix embeds and un-embeds tokens
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                # GPT-2: each residual branch adds to the stream; scale so depth doesn't grow it.
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @property
    def final_norm(self) -> bool:
        """Whether ``ln_f`` runs: iff the last block is pre-LN (post-LN already ends in a norm).

        ``ln_f`` exists either way, so it takes over after ``swap_to_pre_ln``.
        """
        return cast(Block, self.blocks[-1]).norm_position == "pre"

    def num_params(self) -> int:
        """Number of parameters, the tied embedding/head matrix counted once."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: Tensor, targets: Tensor | None = None, cache: Sequence[KVCache] | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Next-token logits for ``idx`` ``(B, T)`` and, given ``targets``, the mean loss.

        Args:
            idx: Token ids, ``(B, T)``.
            targets: Next-token ids, ``(B, T)``; ``-1`` marks positions left out of the loss.
            cache: One ``KVCache`` per block; ``idx`` then holds the positions after the cached.

        Returns:
            Logits ``(B, T, vocab_size)`` and the fp32 cross-entropy loss (None without targets).
        """
        n_layer, block_size = len(self.blocks), self.config.block_size
        if cache is not None and len(cache) != n_layer:
            raise ValueError(
                f"`cache` must hold one KVCache per block ({n_layer}), got {len(cache)}"
            )
        past = 0 if cache is None else cache[0].length
        if past + idx.size(1) > block_size:
            raise ValueError(
                f"sequence length {past + idx.size(1)} exceeds `block_size` {block_size}"
            )
        x = self.wte(idx)  # (B, T, C)
        if self.wpe is not None:
            pos = torch.arange(past, past + idx.size(1), device=idx.device)  # (T,)
            x = x + self.wpe(pos)  # (B, T, C) + (T, C)
        x = self.drop(x)
        for i, block in enumerate(self.blocks):
            x = block(x, None if cache is None else cache[i])
        if self.final_norm:
            x = self.ln_f(x)
        logits: Tensor = self.lm_head(x)  # (B, T, vocab_size)
        if targets is None:
            return logits, None
        # fp32 loss: a log-softmax over the vocabulary in fp16/bf16 loses the small probabilities.
        flat = logits.float().view(-1, logits.size(-1))  # (B * T, vocab_size)
        return logits, F.cross_entropy(flat, targets.reshape(-1), ignore_index=-1)

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` ``(B, T)``; call ``eval()`` first.

        With ``use_cache`` the prompt runs once (prefill), then each step feeds only the new token.
        Once the context outgrows ``block_size`` the cache has no positions left, so every later
        step crops the context to its last ``block_size`` tokens and recomputes them without a
        cache, as ``use_cache=False`` always does (nanoGPT's way).

        Args:
            idx: Prompt token ids, ``(B, T)``.
            max_new_tokens: Tokens to append.
            temperature: Divides the logits; ``0.0`` picks the most likely token (greedy).
            top_k: Sample only among the ``top_k`` most likely tokens.
            use_cache: Decode incrementally with a KV cache.
            generator: Random generator for sampling, for reproducible output.

        Returns:
            Token ids ``(B, T + max_new_tokens)``.
        """
        if max_new_tokens < 0:
            raise ValueError(f"`max_new_tokens` must be >= 0, got {max_new_tokens}")
        if temperature < 0.0:
            raise ValueError(f"`temperature` must be >= 0, got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"`top_k` must be >= 1 or None, got {top_k}")
        block_size = self.config.block_size
        cache = [KVCache() for _ in self.blocks] if use_cache else None
        fed = 0  # tokens of idx already in the cache
        for _ in range(max_new_tokens):
            if cache is not None and idx.size(1) <= block_size:
                logits, _ = self(idx[:, fed:], cache=cache)
                fed = idx.size(1)
            else:
                logits, _ = self(idx[:, -block_size:])
            idx_next = _sample(logits[:, -1, :], temperature, top_k, generator)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


def _sample(
    logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> Tensor:
    """Draw one token id per row of ``logits`` ``(B, vocab_size)``; returns ``(B, 1)``."""
    if temperature == 0.0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)
