"""Deterministic token data for the zoo: next-token, masked-token and sequence-to-sequence
batches, as a tokenizer and a collator would hand them over (right padding, ``attention_mask``,
``-100`` where no loss is taken).

The text is a walk on a fixed random bigram table (each token has two likely successors): a
model learns it, so the loss falls as in a real run, and nothing is read from disk.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["BATCH", "MASK", "PAD", "SEQ", "VOCAB", "lm_batches", "mlm_batches", "s2s_batches"]

VOCAB, SEQ, BATCH = 128, 16, 4
PAD, BOS, EOS, MASK = 0, 1, 2, 3  # special ids; text tokens are >= 4
PADDED = 4  # the last row of every batch is padded on its last PADDED positions

Batch = dict[str, Tensor]


def _text(g: torch.Generator, rows: int) -> Tensor:
    """(rows, SEQ) tokens in [4, VOCAB): a walk on a bigram table drawn from ``g``."""
    successors = torch.randint(4, VOCAB, (VOCAB, 2), generator=g)
    tokens = torch.empty(rows, SEQ, dtype=torch.long)
    tokens[:, 0] = torch.randint(4, VOCAB, (rows,), generator=g)
    coins = torch.randint(0, 2, (rows, SEQ), generator=g)
    for t in range(1, SEQ):
        tokens[:, t] = successors[tokens[:, t - 1], coins[:, t]]
    return tokens


def _padded(ids: Tensor) -> tuple[Tensor, Tensor]:
    """``ids`` with the last row right-padded, and its attention mask."""
    mask = torch.ones_like(ids)
    mask[-1, -PADDED:] = 0
    return ids.masked_fill(mask == 0, PAD), mask


def lm_batches(g: torch.Generator, steps: int) -> list[Batch]:
    """Causal LM batches: ``labels`` are the inputs (the model shifts them), -100 on padding."""
    out = []
    for ids in _text(g, steps * BATCH).split(BATCH):
        ids, mask = _padded(ids)
        out.append(
            {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
        )
    return out


def mlm_batches(g: torch.Generator, steps: int) -> list[Batch]:
    """Masked LM batches: ~15% of the real tokens replaced by MASK; loss only there."""
    out = []
    for ids in _text(g, steps * BATCH).split(BATCH):
        ids, mask = _padded(ids)
        chosen = (torch.rand(ids.shape, generator=g) < 0.15) & (mask == 1)
        chosen[:, 1] = True  # at least one prediction per row
        labels = ids.masked_fill(~chosen, -100)
        out.append(
            {"input_ids": ids.masked_fill(chosen, MASK), "attention_mask": mask, "labels": labels}
        )
    return out


def s2s_batches(g: torch.Generator, steps: int) -> list[Batch]:
    """Sequence-to-sequence batches: the target is the source under a fixed token mapping (a
    toy translation); the model builds its decoder inputs from ``labels``."""
    mapping = torch.cat([torch.arange(4), 4 + torch.randperm(VOCAB - 4, generator=g)])
    out = []
    for ids in _text(g, steps * BATCH).split(BATCH):
        ids, mask = _padded(ids)
        labels = mapping[ids].masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out
