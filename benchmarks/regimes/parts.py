"""Building blocks of the text regimes: real text, a small GPT, a post-LN encoder, LoRA.

Two kinds of real text, neither downloaded: Python code (the demo's stdlib corpus) and English
prose (the standard library's own help texts, ``pydoc_data.topics``: ~460 kB of the Python
reference manual, in every CPython). A change from one to the other is a new domain, as a
second training stage on new data is.
"""

from __future__ import annotations

import math
import sysconfig
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stabilizer.demo.config import GPTConfig
from stabilizer.demo.data import load_corpus
from stabilizer.demo.model import GPT

__all__ = [
    "Encoder",
    "LoRALinear",
    "code",
    "encoder_loss",
    "gpt_hidden",
    "lm_eval",
    "prose",
    "small_gpt",
    "tables",
    "text_batch",
    "warmup_cosine",
]

Tokens = npt.NDArray[np.uint8]
_CHARMAPS = ("cp", "iso8859_", "mac_", "koi8_", "kz1048", "ptcp", "hp_", "tis_", "palmos")


@lru_cache(maxsize=1)
def code() -> tuple[Tokens, Tokens]:
    """Python code: the demo corpus's train and validation bytes (split by file)."""
    corpus = load_corpus()
    return corpus.train, corpus.val


@lru_cache(maxsize=1)
def tables() -> tuple[Tokens, Tokens]:
    """Easy code: the stdlib's charmap codecs (``encodings/cp*.py``, ``iso8859_*.py``, ...,
    ~1.3 MB of near-identical tables), every 10th file held out."""
    root = Path(sysconfig.get_paths()["stdlib"]) / "encodings"
    files = sorted(p for p in root.glob("*.py") if p.name.startswith(_CHARMAPS))
    parts: tuple[list[bytes], list[bytes]] = ([], [])
    for i, path in enumerate(files):
        parts[i % 10 == 9].append(path.read_bytes())
    train, val = (np.frombuffer(b"".join(p), dtype=np.uint8) for p in parts)
    return train, val


@lru_cache(maxsize=1)
def prose() -> tuple[Tokens, Tokens]:
    """English prose: the help topics of ``pydoc_data.topics``, 90% train, 10% validation."""
    from pydoc_data.topics import topics

    raw = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    tokens = np.frombuffer(raw, dtype=np.uint8)
    cut = int(len(tokens) * 0.9)
    return tokens[:cut], tokens[cut:]


def text_batch(tokens: Tokens, rng: np.random.Generator, batch: int, length: int) -> Tensor:
    """``batch`` random windows of ``length + 1`` bytes, ``(batch, length + 1)`` int64."""
    starts = rng.integers(0, len(tokens) - length - 1, batch)
    return torch.from_numpy(np.stack([tokens[s : s + length + 1] for s in starts]).astype(np.int64))


def small_gpt(block_size: int = 32, n_layer: int = 2) -> GPT:
    """The reference GPT (pre-LN, learned positions), small enough for ~10 ms a step."""
    return GPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=64, block_size=block_size))


def gpt_hidden(gpt: GPT, idx: Tensor) -> Tensor:
    """The reference GPT's final hidden states ``(B, T, C)`` (what its head reads), for a second
    head on the same trunk."""
    x = gpt.wte(idx)  # (B, T, C)
    if gpt.wpe is not None:
        x = x + gpt.wpe(torch.arange(idx.size(1), device=idx.device))
    for block in gpt.blocks:
        x = block(x)
    out: Tensor = gpt.ln_f(x) if gpt.final_norm else x
    return out


def lm_eval(val: Tokens, length: int, batches: int = 8) -> Callable[[nn.Module], float]:
    """Next-byte cross-entropy of a GPT on ``batches`` fixed windows of ``val``."""
    rng = np.random.default_rng(12345)
    held = [text_batch(val, rng, 16, length) for _ in range(batches)]

    def evaluate(net: nn.Module) -> float:
        gpt = cast(GPT, getattr(net, "gpt", net))  # the GPT itself, or a module around it
        losses = [gpt(t[:, :-1], t[:, 1:])[1] for t in held]
        return float(torch.stack([x for x in losses if x is not None]).mean())

    return evaluate


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup: int, steps: int) -> dict[str, Any]:
    """configure_optimizers' dict: linear warmup, then cosine to 10%, stepped every step."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Encoder(nn.Module):
    """A byte LM on PyTorch's own post-LN stack: `nn.TransformerEncoder` of
    `nn.TransformerEncoderLayer` (``norm_first=False``: the 2017 layout, BERT's) under a causal
    mask, no final norm (post-LN ends in one), a linear head."""

    def __init__(self, n_layer: int = 2, width: int = 64, length: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, width)
        self.pos = nn.Embedding(length, width)
        layer = nn.TransformerEncoderLayer(
            width, 4, 4 * width, dropout=0.0, batch_first=True, norm_first=False
        )
        self.encoder = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.head = nn.Linear(width, 256)

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.size(1)
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=idx.device)
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))  # (B, T, C)
        logits: Tensor = self.head(self.encoder(x, mask=mask, is_causal=True))  # (B, T, 256)
        return logits


def encoder_loss(net: nn.Module, batch: Tensor) -> Tensor:
    """Next-byte cross-entropy of an `Encoder` on windows ``(B, T + 1)``."""
    logits = net(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


class LoRALinear(nn.Module):
    """``base(x) + (x A B) * alpha / r`` around a frozen ``nn.Linear``: ``B`` starts at 0, so the
    adapter starts as the identity and ``A`` gets no gradient until ``B`` has moved (Hu et al.
    2021)."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(base.in_features, r) / math.sqrt(base.in_features))
        self.b = nn.Parameter(torch.zeros(r, base.out_features))
        self.scale = alpha / r

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.base(x) + (x @ self.a @ self.b) * self.scale
        return out
