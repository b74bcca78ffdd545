"""A small hand-written language model and the idioms that change one thing of it: EMA copies
in buffers; tied, unused and frozen parameters; an unused ``torch.empty`` parameter holding NaN;
a running-max buffer that starts at ``-inf``; a ``-inf`` causal mask stored as a frozen
Parameter; int and bool buffers; running statistics that first change after a warm-up; noise
drawn from a ``torch.Generator`` the module holds.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from zoo_data import SEQ, VOCAB

__all__ = [
    "EMALM",
    "D",
    "FrozenMaskLM",
    "IntBoolBuffersLM",
    "LateStatisticLM",
    "NaNReservedLM",
    "OwnGeneratorLM",
    "RunningMaxLM",
    "TiedUnusedFrozenLM",
    "TinyLM",
]

D = 32  # model width


class TinyLM(nn.Module):
    """Embedding, one causal attention layer written by hand, an MLP, a head: the base the
    idioms below change one thing of."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, D), nn.Embedding(SEQ, D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.ln = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 64), nn.GELU(), nn.Linear(64, D))
        self.head = nn.Linear(D, VOCAB)

    def causal_bias(self, t: int) -> Tensor:
        return torch.zeros(t, t).masked_fill(torch.ones(t, t).triu(1) == 1, -math.inf)

    def attend(self, h: Tensor) -> Tensor:
        q, k, v = self.qkv(h).chunk(3, dim=-1)  # (B, T, D) each
        scores = q @ k.transpose(1, 2) / math.sqrt(D) + self.causal_bias(h.size(1))  # (B, T, T)
        return self.proj(scores.softmax(-1) @ v)

    def hidden(self, ids: Tensor) -> Tensor:
        h = self.embed(ids) + self.pos(torch.arange(ids.size(1)))
        h = h + self.attend(self.ln(h))
        return h + self.mlp(h)

    def forward(self, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        logits: Tensor = self.head(self.hidden(ids))  # causal: padding on the right is harmless
        return logits


class EMALM(TinyLM):
    """An EMA of every parameter kept in buffers and updated after each step."""

    DECAY = 0.9

    def __init__(self) -> None:
        super().__init__()
        self.names = [n for n, _ in self.named_parameters()]
        for name, p in self.named_parameters():
            self.register_buffer("ema_" + name.replace(".", "_"), p.detach().clone())

    @torch.no_grad()
    def update_ema(self) -> None:
        for name, p in self.named_parameters():
            self.get_buffer("ema_" + name.replace(".", "_")).lerp_(p, 1 - self.DECAY)


class TiedUnusedFrozenLM(TinyLM):
    """The head tied to the embedding, an unused parameter, a frozen layer and frozen sinusoidal
    positions (both used in the forward, neither in the optimizer)."""

    def __init__(self) -> None:
        super().__init__()
        del self.pos  # positions: the frozen sinusoid below
        self.head.weight = self.embed.weight  # tied
        self.spare = nn.Parameter(torch.randn(D))  # never used: no gradient, ever
        self.frozen = nn.Linear(D, D).requires_grad_(False)
        angles = torch.arange(SEQ).view(-1, 1) / 10000 ** (torch.arange(D) / D)
        self.sinusoid = nn.Parameter(torch.sin(angles), requires_grad=False)

    def hidden(self, ids: Tensor) -> Tensor:
        h = self.frozen(self.embed(ids) + self.sinusoid[: ids.size(1)])
        h = h + self.attend(self.ln(h))
        return h + self.mlp(h)


class NaNReservedLM(TinyLM):
    """An unused parameter made with ``torch.empty``: whatever memory held, here NaN (filled, so
    that the case is the same on every machine). It never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.reserved = nn.Parameter(torch.empty(4, D))
        with torch.no_grad():
            self.reserved.fill_(math.nan)


class AmaxTracker(nn.Module):
    """Identity that tracks the running max of |x| (an fp8-style amax) in a buffer that starts
    at ``-inf``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("amax", torch.tensor(-math.inf))

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self.amax.copy_(torch.maximum(self.amax, x.detach().abs().amax()))
        return x


class RunningMaxLM(TinyLM):
    """The MLP's output passes an `AmaxTracker`."""

    def __init__(self) -> None:
        super().__init__()
        self.tracker = AmaxTracker()

    def hidden(self, ids: Tensor) -> Tensor:
        h = self.embed(ids) + self.pos(torch.arange(ids.size(1)))
        h = h + self.attend(self.ln(h))
        return h + self.tracker(self.mlp(h))


class FrozenMaskLM(TinyLM):
    """The causal mask is a frozen Parameter holding ``-inf`` above the diagonal."""

    def __init__(self) -> None:
        super().__init__()
        mask = torch.full((SEQ, SEQ), -math.inf).triu(1)
        self.mask = nn.Parameter(mask, requires_grad=False)

    def causal_bias(self, t: int) -> Tensor:
        return self.mask[:t, :t]


class IntBoolBuffersLM(TinyLM):
    """Int and bool buffers: position ids (int64, as HF keeps them), a step counter the forward
    increments, a bool mask of the embedding features kept."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("position_ids", torch.arange(SEQ).unsqueeze(0))
        self.register_buffer("forwards", torch.zeros((), dtype=torch.long))
        self.register_buffer("keep", torch.arange(D) % 8 != 7)

    def hidden(self, ids: Tensor) -> Tensor:
        if self.training:
            self.forwards += 1
        h = self.embed(ids) * self.keep + self.pos(self.position_ids[:, : ids.size(1)])
        h = h + self.attend(self.ln(h))
        return h + self.mlp(h)


class LateStatistic(nn.Module):
    """Normalises its input by running mean and variance that it starts updating only after a
    warm-up of `WARMUP` training forwards (statistics estimated once the features settle)."""

    WARMUP, MOMENTUM = 5, 0.1

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(D))
        self.register_buffer("var", torch.ones(D))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self.seen += 1
            if self.seen > self.WARMUP:
                flat = x.detach().reshape(-1, x.size(-1))  # (B*T, D)
                self.mean.lerp_(flat.mean(0), self.MOMENTUM)
                self.var.lerp_(flat.var(0), self.MOMENTUM)
        return (x - self.mean) / (self.var + 1e-5).sqrt()


class LateStatisticLM(TinyLM):
    """The MLP's output passes a `LateStatistic`: its mean and variance first change at step 5."""

    def __init__(self) -> None:
        super().__init__()
        self.stat = LateStatistic()

    def hidden(self, ids: Tensor) -> Tensor:
        h = self.embed(ids) + self.pos(torch.arange(ids.size(1)))
        h = h + self.attend(self.ln(h))
        return h + self.stat(self.mlp(h))


class OwnGeneratorLM(TinyLM):
    """NEFTune-style noise on the embeddings in training, drawn from a ``torch.Generator`` the
    module holds (so that the noise is reproducible whatever else draws random numbers)."""

    ALPHA = 5.0

    def __init__(self) -> None:
        super().__init__()
        self.noise = torch.Generator().manual_seed(0)

    def hidden(self, ids: Tensor) -> Tensor:
        h = self.embed(ids) + self.pos(torch.arange(ids.size(1)))
        if self.training:
            u = torch.rand(h.shape, generator=self.noise) * 2 - 1  # U(-1, 1), (B, T, D)
            h = h + u * self.ALPHA / math.sqrt(h.size(1) * h.size(2))
        h = h + self.attend(self.ln(h))
        return h + self.mlp(h)
