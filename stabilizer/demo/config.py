"""``GPTConfig``: the reference GPT's configuration, importable without torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["AttentionImpl", "GPTConfig", "NormPosition", "Positions", "Softmax"]

NormPosition = Literal["pre", "post"]
Positions = Literal["learned", "rope"]
AttentionImpl = Literal["sdpa", "manual"]
Softmax = Literal["library", "naive"]

_CHOICES: dict[str, tuple[str, ...]] = {
    "norm_position": ("pre", "post"),
    "positions": ("learned", "rope"),
    "attention": ("sdpa", "manual"),
    "softmax": ("library", "naive"),
}


def check_choice(name: str, value: str) -> None:
    choices = _CHOICES[name]
    if value not in choices:
        valid = ", ".join(repr(c) for c in choices)
        raise ValueError(f"`{name}` must be one of {valid}, got {value!r}")


@dataclass(frozen=True)
class GPTConfig:
    """Shape and stability knobs of the reference GPT; the defaults are small enough for a CPU."""

    vocab_size: int = 256  # byte-level corpus: every byte is a token
    n_layer: int = 4  # number of Transformer blocks
    n_head: int = 4  # attention heads per block
    n_embd: int = 128  # width of the residual stream
    block_size: int = 128  # longest context the model sees (learned positions, mask, rope tables)
    dropout: float = 0.0  # on embeddings, attention weights and residual branches
    bias: bool = True  # biases in Linear and LayerNorm layers, as GPT-2
    norm_position: NormPosition = "pre"  # LayerNorm before each sublayer (GPT-2) or after (2017)
    softmax_fp32: bool = False  # attention scores QKᵀ/√d and softmax in fp32 for fp16/bf16 inputs
    positions: Positions = "learned"  # learned absolute embeddings (GPT-2) or rotary (RoPE)
    attention: AttentionImpl = "sdpa"  # fused scaled_dot_product_attention or the plain path
    # "naive": the plain path's softmax is hand-written, exp(s) / sum(exp(s)) without subtracting
    # the row's max, in the scores' dtype: in fp16 exp overflows once a score exceeds ~11.1.
    softmax: Softmax = "library"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "n_embd", "block_size"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"`{name}` must be >= 1, got {value}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"`dropout` must be in [0, 1), got {self.dropout}")
        for name in _CHOICES:
            check_choice(name, getattr(self, name))
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                "`n_embd` must be divisible by `n_head`, "
                f"got n_embd={self.n_embd}, n_head={self.n_head}"
            )
        head_size = self.n_embd // self.n_head
        if self.positions == "rope" and head_size % 2 != 0:
            raise ValueError(
                f"`n_embd // n_head` must be even for rotary positions, got {head_size}"
            )
