"""``torch.nn`` idioms, written the way PyTorch's docs and common code write them.

Causal masks kept as buffers (``nn.Transformer.generate_square_subsequent_mask``'s float ``-inf``
mask, a bool ``triu`` mask), ``key_padding_mask``, ``nn.MultiheadAttention``, quantization-aware
training (observers start at ``+inf``/``-inf``), ``parametrize`` (weight and spectral norm, whose
power iteration writes buffers every forward), BatchNorm and GroupNorm CNNs, EMA copies in
buffers, tied, unused and frozen parameters, an unused ``torch.empty`` parameter holding NaN, a
running-max buffer that starts at ``-inf``, a ``-inf`` mask stored as a frozen Parameter, int and
bool buffers, running statistics that first change after a warm-up, noise drawn from a
generator the module holds (`zoo_odd`). Several of these hold NaN/Inf before training by design.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.ao import quantization as tq
from torch.nn import functional as F
from torch.nn.utils import parametrizations
from zoo_data import BATCH, BOS, PAD, SEQ, VOCAB, lm_batches, s2s_batches
from zoo_harness import STEPS, Batch, Case
from zoo_odd import (
    EMALM,
    D,
    FrozenMaskLM,
    IntBoolBuffersLM,
    LateStatisticLM,
    NaNReservedLM,
    OwnGeneratorLM,
    RunningMaxLM,
    TiedUnusedFrozenLM,
)

__all__ = ["TORCH_CASES"]

CLASSES = 4


def _next_token_loss(logits: Tensor, batch: Batch) -> Tensor:
    """Cross-entropy of position t's logits against token t+1; -100 (padding) ignored."""
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1), ignore_index=-100
    )


def _images(g: torch.Generator) -> list[Batch]:
    """Batches of 3x8x8 images whose class sets the mean of one channel, plus noise."""
    out = []
    for _ in range(STEPS):
        y = torch.randint(0, CLASSES, (BATCH * 2,), generator=g)
        x = torch.randn(BATCH * 2, 3, 8, 8, generator=g)
        x[:, 0] += y.view(-1, 1, 1).float() - 1.5
        out.append({"x": x, "y": y})
    return out


def _lm_data(g: torch.Generator) -> list[Batch]:
    return lm_batches(g, STEPS)


def _lm_loss(model: nn.Module, batch: Batch) -> Tensor:
    """A language model returns logits ``(B, T, VOCAB)`` for ``(input_ids, attention_mask)``."""
    return _next_token_loss(model(batch["input_ids"], batch["attention_mask"]), batch)


def _image_loss(model: nn.Module, batch: Batch) -> Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


def _case(name: str, build: type[nn.Module], fault: str, images: bool = False) -> Case:
    data, loss = (_images, _image_loss) if images else (_lm_data, _lm_loss)
    return Case(name=name, build=build, batches=data, loss=loss, fault=fault)


# --- nn.Transformer, nn.TransformerEncoder, nn.MultiheadAttention --------------------------


class TranslationTransformer(nn.Module):
    """PyTorch's translation tutorial: ``nn.Transformer`` with the float causal mask of
    ``generate_square_subsequent_mask`` kept as a buffer (``-inf`` above the diagonal) and bool
    ``key_padding_mask``\\ s for source, target and memory."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D, padding_idx=PAD)
        self.pos = nn.Parameter(torch.randn(1, SEQ, D) * 0.02)  # learned positions
        self.transformer = nn.Transformer(
            d_model=D, nhead=4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64,
            batch_first=True,
        )  # fmt: skip
        self.head = nn.Linear(D, VOCAB)
        self.register_buffer("tgt_mask", nn.Transformer.generate_square_subsequent_mask(SEQ))

    def forward(self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor) -> Tensor:
        target = torch.cat([torch.full_like(labels[:, :1], BOS), labels[:, :-1]], 1)
        target = target.masked_fill(target < 0, PAD)  # teacher forcing, shifted right
        src_pad = attention_mask == 0
        out = self.transformer(
            self.embed(input_ids) + self.pos, self.embed(target) + self.pos,
            tgt_mask=self.tgt_mask, src_key_padding_mask=src_pad,
            tgt_key_padding_mask=target == PAD, memory_key_padding_mask=src_pad,
        )  # fmt: skip
        logits: Tensor = self.head(out)
        return logits


def _translation_loss(model: nn.Module, batch: Batch) -> Tensor:
    logits = model(batch["input_ids"], batch["attention_mask"], batch["labels"])
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1))


class EncoderLM(nn.Module):
    """A GPT built from ``nn.TransformerEncoder`` (pre-LN): a bool causal mask buffer
    (``triu``, True = masked), ``is_causal`` and a bool ``src_key_padding_mask``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(SEQ, D)
        layer = nn.TransformerEncoderLayer(D, 4, 64, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D, VOCAB)
        causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        h = self.embed(ids) + self.pos(torch.arange(ids.size(1)))
        pad = None if attention_mask is None else attention_mask == 0
        h = self.encoder(h, mask=self.causal, src_key_padding_mask=pad, is_causal=True)
        logits: Tensor = self.head(h)
        return logits


class MHABlock(nn.Module):
    """Pre-LN block around ``nn.MultiheadAttention`` with a float additive mask."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 4, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: Tensor, mask: Tensor, pad: Tensor) -> Tensor:
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, key_padding_mask=pad, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class MHALM(nn.Module):
    """A language model of ``nn.MultiheadAttention`` blocks; the float causal mask is a buffer,
    the padding a float ``key_padding_mask`` (``-inf`` on padding) of the same type."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, D), nn.Embedding(SEQ, D)
        self.blocks = nn.ModuleList(MHABlock() for _ in range(2))
        self.head = nn.Linear(D, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ))

    def forward(self, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        pad = torch.zeros(ids.shape)
        if attention_mask is not None:
            pad = pad.masked_fill(attention_mask == 0, -math.inf)
        h = self.embed(ids) + self.pos(torch.arange(ids.size(1)))
        for block in self.blocks:
            h = block(h, self.mask, pad)
        logits: Tensor = self.head(h)
        return logits


# --- CNNs: quantization-aware training, BatchNorm, GroupNorm ---------------------------------


class QATNet(nn.Module):
    """A CNN prepared for quantization-aware training as PyTorch's QAT tutorial does: fused
    Conv-BN-ReLU, ``get_default_qat_qconfig``, ``prepare_qat``. Its observers hold min ``+inf``
    and max ``-inf`` until they first see data."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = tq.QuantStub(), tq.DeQuantStub()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.relu1, self.relu2 = nn.ReLU(), nn.ReLU()
        self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(8, CLASSES)
        self.train()
        self.qconfig = tq.get_default_qat_qconfig("x86")
        fused = [["conv1", "bn1", "relu1"], ["conv2", "bn2", "relu2"]]
        tq.fuse_modules_qat(self, fused, inplace=True)  # each bn and relu is now an Identity
        tq.prepare_qat(self, inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        h = self.relu1(self.bn1(self.conv1(self.quant(x))))
        h = self.relu2(self.bn2(self.conv2(h)))
        logits: Tensor = self.dequant(self.fc(self.pool(h).flatten(1)))
        return logits


class BatchNormCNN(nn.Module):
    """Conv-BN-ReLU twice, pooling, a linear head: running statistics and an int64
    ``num_batches_tracked`` in buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )  # fmt: skip
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        logits: Tensor = self.head(self.features(x))
        return logits


class GNBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(4, channels)
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv(F.silu(self.norm(x)))


class GroupNormCNN(nn.Module):
    """Residual GroupNorm-SiLU-Conv blocks (the diffusion U-Net's block): no buffers at all."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.blocks = nn.Sequential(GNBlock(16), GNBlock(16))
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        logits: Tensor = self.head(self.blocks(self.stem(x)).mean((2, 3)))
        return logits


# --- parametrize: weight norm, spectral norm -------------------------------------------------


class WeightNormMLP(nn.Module):
    """A token MLP whose linears are ``parametrizations.weight_norm``-ed (g and v parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.net = nn.Sequential(
            parametrizations.weight_norm(nn.Linear(D, 64)), nn.GELU(),
            parametrizations.weight_norm(nn.Linear(64, D)),
        )  # fmt: skip
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        logits: Tensor = self.head(self.net(self.embed(ids)))
        return logits


class SpectralNormCritic(nn.Module):
    """A GAN-critic-style CNN with ``parametrizations.spectral_norm``: its power iteration
    rewrites the ``_u``/``_v`` buffers in place at every training forward."""

    def __init__(self) -> None:
        super().__init__()
        sn = parametrizations.spectral_norm
        self.net = nn.Sequential(
            sn(nn.Conv2d(3, 8, 3, padding=1)), nn.LeakyReLU(0.2),
            sn(nn.Conv2d(8, 16, 3, stride=2, padding=1)), nn.LeakyReLU(0.2),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), sn(nn.Linear(16, CLASSES)),
        )  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        logits: Tensor = self.net(x)
        return logits


def _ema() -> Case:
    def update(model: nn.Module) -> None:
        assert isinstance(model, EMALM)
        model.update_ema()

    return Case(name="ema_buffers", build=EMALM, batches=_lm_data, loss=_lm_loss, fault="mlp",
                after_step=update)  # fmt: skip


TORCH_CASES: list[Case] = [
    Case(name="nn_transformer_float_mask", build=TranslationTransformer,
         batches=lambda g: s2s_batches(g, STEPS), loss=_translation_loss,
         fault="transformer.encoder.layers.1.linear2"),
    _case("transformer_encoder_bool_mask", EncoderLM, "encoder.layers.1.linear2"),
    _case("multihead_attention", MHALM, "blocks.1.attn"),
    _case("qat_prepare", QATNet, "conv2", images=True),
    _case("batchnorm_cnn", BatchNormCNN, "features.3", images=True),
    _case("groupnorm_cnn", GroupNormCNN, "blocks.1.conv", images=True),
    _case("weight_norm", WeightNormMLP, "net.2"),
    _case("spectral_norm", SpectralNormCritic, "net.2", images=True),
    _ema(),
    _case("tied_unused_frozen", TiedUnusedFrozenLM, "mlp"),
    _case("nan_unused_param", NaNReservedLM, "mlp"),
    _case("running_max_buffer", RunningMaxLM, "mlp"),
    _case("frozen_inf_mask_param", FrozenMaskLM, "mlp"),
    _case("int_bool_buffers", IntBoolBuffersLM, "mlp"),
    _case("late_running_stat", LateStatisticLM, "mlp"),
    _case("own_generator_noise", OwnGeneratorLM, "mlp"),
]  # fmt: skip
