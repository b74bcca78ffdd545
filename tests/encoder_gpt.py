"""A small GPT built from ``torch.nn.TransformerEncoderLayer`` with a causal mask.

Not the reference model: a second, independently written decoder-only Transformer, with PyTorch's
own parameter names (``encoder.layers.N.``), to show the monitor works beyond our own GPT.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stabilizer.callbacks.demo.lit_gpt import LitGPT
from stabilizer.demo.config import GPTConfig


class EncoderLM(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        C = config.n_embd
        self.tok = nn.Embedding(config.vocab_size, C)
        self.pos = nn.Embedding(config.block_size, C)
        layer = nn.TransformerEncoderLayer(
            C,
            config.n_head,
            4 * C,
            dropout=0.0,
            batch_first=True,
            norm_first=config.norm_position == "pre",
            activation="gelu",
        )
        final = nn.LayerNorm(C) if config.norm_position == "pre" else None
        self.encoder = nn.TransformerEncoder(
            layer, config.n_layer, norm=final, enable_nested_tensor=False
        )
        self.head = nn.Linear(C, config.vocab_size, bias=False)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        T = idx.size(1)
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=idx.device)
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        logits: Tensor = self.head(self.encoder(x, mask=mask, is_causal=True))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class LitEncoderGPT(LitGPT):
    """``LitGPT``'s optimizer and schedule around :class:`EncoderLM`."""

    def __init__(self, config: GPTConfig, **kwargs: object) -> None:
        super().__init__(config, **kwargs)  # type: ignore[arg-type]
        self.model = EncoderLM(config)  # type: ignore[assignment]
