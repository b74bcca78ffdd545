"""Healthy regimes on real text: the reference GPT and a post-LN encoder.

Each changes something on purpose that a monitor could take for a failure: the data (a second
stage, a curriculum), the loss (a term switched on, a zero-loss warm-up, all-padding batches,
label smoothing), the model's layout (post-LN with no warmup, frozen or pretrained weights).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import ConcatDataset, DataLoader

from stabilizer.demo.model import Block

from .base import Batches, LossFn, Regime, Setup, loader, regime
from .parts import (
    Encoder,
    LoRALinear,
    Tokens,
    code,
    encoder_loss,
    gpt_hidden,
    lm_eval,
    prose,
    small_gpt,
    tables,
    text_batch,
    warmup_cosine,
)

__all__ = ["TEXT_REGIMES"]

LENGTH, BATCH = 32, 16


def _lm_loss(net: nn.Module, batch: Tensor, step: int) -> Tensor:
    loss: Tensor = net(batch[:, :-1], batch[:, 1:])[1]
    return loss


def _adamw(lr: float, warmup: int, steps: int) -> Any:
    def make(net: nn.Module) -> Any:
        params = [p for p in net.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
        return warmup_cosine(opt, warmup, steps)

    return make


def _windows(tokens: Tokens, batch: int = BATCH, length: int = LENGTH) -> Any:
    return lambda rng, i: text_batch(tokens, rng, batch, length)


def _gpt_setup(
    steps: int,
    data: Callable[[int], DataLoader[Any]],
    val: Tokens,
    net: nn.Module | None = None,
    loss: LossFn = _lm_loss,
    trainer_args: Mapping[str, Any] | None = None,
) -> Setup:
    """The reference GPT (or ``net``, holding it as ``.gpt``) under AdamW 3e-3 with a 10%
    warmup and a cosine, judged by its next-byte loss on ``val``."""
    optimizer = _adamw(3e-3, max(1, steps // 10), steps)
    model = small_gpt() if net is None else net
    return Setup(model, loss, optimizer, data, lm_eval(val, LENGTH), trainer_args or {})


def curriculum(seed: int, steps: int) -> Setup:
    """Sequence length 8, then 16, then 32 (a new loader each epoch): positions never trained
    before come in at each doubling."""
    train, val = code()
    per = max(1, steps // 3)

    def data(epoch: int) -> DataLoader[Any]:
        length = 8 * 2 ** min(epoch, 2)
        return loader(_windows(train, length=length), per, seed + 1000 * epoch)

    return _gpt_setup(steps, data, val, trainer_args={"reload_dataloaders_every_n_epochs": 1})


def staged(seed: int, steps: int) -> Setup:
    """An easy first stage (the stdlib's codec tables, epoch 0), then all of the stdlib's code
    (epoch 1, a new loader): the loss jumps ~1.4 nats to a new level, then falls."""
    (tables_train, _), (code_train, code_val) = tables(), code()
    half = max(1, steps // 2)

    def data(epoch: int) -> DataLoader[Any]:
        tokens = tables_train if epoch == 0 else code_train
        return loader(_windows(tokens), half, seed + 1000 * epoch)

    reload = {"reload_dataloaders_every_n_epochs": 1}
    return _gpt_setup(steps, data, code_val, trainer_args=reload)


def staged_internal(seed: int, steps: int) -> Setup:
    """Codec tables for 2/5 of the run, then English prose, in one loader: an unshuffled
    ``ConcatDataset`` of the two stages (a new domain mid-epoch)."""
    (tables_train, _), (prose_train, prose_val) = tables(), prose()
    half = max(1, steps * 2 // 5)
    stages = [
        Batches(_windows(tables_train), half, seed),
        Batches(_windows(prose_train), steps - half, seed + 1),
    ]

    def data(epoch: int) -> DataLoader[Any]:
        return DataLoader(ConcatDataset(stages), batch_size=None, shuffle=False)

    return _gpt_setup(steps, data, prose_val)


def grad_accum(seed: int, steps: int) -> Setup:
    """Micro-batches of 8 windows, 4 accumulated per optimizer step."""
    train, val = code()

    def data(epoch: int) -> DataLoader[Any]:
        return loader(_windows(train, batch=8), 4 * steps, seed + 1000 * epoch)

    accumulate = {"accumulate_grad_batches": 4}
    return _gpt_setup(steps, data, val, trainer_args=accumulate)


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gpt = small_gpt()
        self.ahead = nn.Linear(64, 256)  # predicts the byte after next (multi-token prediction)

    def forward(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        h = gpt_hidden(self.gpt, idx)  # (B, T, C)
        return self.gpt.lm_head(h), self.ahead(h)  # (B, T, V) each


def aux_term(seed: int, steps: int) -> Setup:
    """From a third of the run on, a second head predicts the byte after next and its loss is
    added: the total loss jumps ~2.5x, then falls."""
    train, val = code()
    start = steps // 3

    def loss(net: nn.Module, batch: Tensor, step: int) -> Tensor:
        y = batch[:, 1:]
        logits, ahead = net(batch[:, :-1])  # (B, T, V) each
        main = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        if step < start:
            return main
        # position t predicts the byte at t + 2
        return main + F.cross_entropy(ahead[:, :-1].flatten(0, 1), y[:, 1:].flatten())

    data = _epochs(train, steps, seed)
    return _gpt_setup(steps, data, val, net=_TwoHeads(), loss=loss)


def _epochs(tokens: Tokens, steps: int, seed: int) -> Any:
    return lambda epoch: loader(_windows(tokens), steps, seed + 1000 * epoch)


def zero_warmup(seed: int, steps: int) -> Setup:
    """The loss is ``weight * cross_entropy`` with the weight 0 for the first fifth of the run
    (no supervised term yet: the loss is exactly 0, the gradients exactly 0), then 1."""
    train, val = code()
    start = steps // 5

    def loss(net: nn.Module, batch: Tensor, step: int) -> Tensor:
        weight = 0.0 if step < start else 1.0
        return weight * _lm_loss(net, batch, step)

    return _gpt_setup(steps, _epochs(train, steps, seed), val, loss=loss)


def label_smoothing(seed: int, steps: int) -> Setup:
    """Cross-entropy with label smoothing 0.1: the loss floors well above the eval's."""
    train, val = code()

    def loss(net: nn.Module, batch: Tensor, step: int) -> Tensor:
        logits = net(batch[:, :-1])[0].flatten(0, 1)
        return F.cross_entropy(logits, batch[:, 1:].flatten(), label_smoothing=0.1)

    return _gpt_setup(steps, _epochs(train, steps, seed), val, loss=loss)


def wd_only(seed: int, steps: int) -> Setup:
    """A masked loss over padded windows; every 4th batch is all padding (a packed loader's
    tail): loss exactly 0, gradients exactly 0, the step only AdamW's decay and momentum."""
    train, val = code()

    def make(rng: np.random.Generator, i: int) -> Any:
        batch = text_batch(train, rng, BATCH, LENGTH)
        keep = torch.from_numpy(rng.integers(LENGTH // 4, LENGTH + 1, BATCH))  # real lengths
        mask = torch.arange(LENGTH)[None, :] < keep[:, None]  # (B, T)
        return batch, mask & (i % 4 != 3)

    def loss(net: nn.Module, batch: Any, step: int) -> Tensor:
        tokens, mask = batch
        logits = net(tokens[:, :-1])[0]  # (B, T, V)
        per = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
        masked: Tensor = (per * mask.flatten()).sum() / mask.sum().clamp(min=1)
        return masked

    data = lambda epoch: loader(make, steps, seed + 1000 * epoch)  # noqa: E731
    return _gpt_setup(steps, data, val, loss=loss)


def _pretrain(net: nn.Module, loss: Any, make: Any, steps: int, seed: int) -> None:
    """A plain training loop (AdamW, 30-step warmup): the "pretrained" weights."""
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3 if isinstance(net, Encoder) else 3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 30))
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        loss(net, make(np.random.default_rng((seed, 10**6 + i)), i)).backward()
        opt.step()
        sched.step()


def lora(seed: int, steps: int) -> Setup:
    """A GPT pretrained on code (a plain loop, 200 steps), frozen; rank-4 LoRA adapters on
    every attention and MLP input projection, fine-tuned on prose."""
    (code_train, _), (prose_train, prose_val) = code(), prose()
    gpt = small_gpt()
    _pretrain(gpt, lambda n, b: _lm_loss(n, b, 0), _windows(code_train), 200, seed)
    gpt.requires_grad_(False)
    for block in cast(list[Block], gpt.blocks):
        block.attn.c_attn = LoRALinear(block.attn.c_attn)  # type: ignore[assignment]
        block.mlp.c_fc = LoRALinear(block.mlp.c_fc)  # type: ignore[assignment]
    return _gpt_setup(steps, _epochs(prose_train, steps, seed), prose_val, net=gpt)


def _encoder_setup(net: Encoder, seed: int, steps: int, train: Tokens, val: Tokens) -> Setup:
    """Next-byte prediction with Adam at a constant 1e-3 (no scheduler, no warmup)."""
    held = [text_batch(val, np.random.default_rng((12345, i)), BATCH, LENGTH) for i in range(8)]

    def evaluate(net: nn.Module) -> float:
        return float(torch.stack([encoder_loss(net, b) for b in held]).mean())

    def optimizer(net: nn.Module) -> Any:
        return torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=1e-3)

    loss = lambda n, b, s: encoder_loss(n, b)  # noqa: E731
    return Setup(net, loss, optimizer, _epochs(train, steps, seed), evaluate)


def post_ln_finetune(seed: int, steps: int) -> Setup:
    """A post-LN `nn.TransformerEncoder` LM pretrained on code (a plain loop, 200 steps, with
    warmup), frozen; a new head learns English prose at a constant LR (a head on frozen features
    needs no warmup)."""
    (code_train, _), (prose_train, prose_val) = code(), prose()
    net = Encoder()
    _pretrain(net, encoder_loss, _windows(code_train), 200, seed)
    net.requires_grad_(False)
    net.head = nn.Linear(64, 256)
    return _encoder_setup(net, seed, steps, prose_train, prose_val)


def post_ln_scratch(seed: int, steps: int) -> Setup:
    """A 2-layer post-LN `nn.TransformerEncoder` LM trained from scratch on code with Adam at a
    constant 1e-3, no warmup: shallow and at a modest LR, it learns steadily."""
    train, val = code()
    return _encoder_setup(Encoder(), seed, steps, train, val)


_LM = "next-byte cross-entropy on held-out windows"
TEXT_REGIMES: tuple[Regime, ...] = (
    regime("curriculum", curriculum, 300, _LM + " (length 32)"),
    regime("staged", staged, 300, _LM + " of code (the second stage)"),
    regime("staged-internal", staged_internal, 300, _LM + " of prose (the second stage)"),
    regime("grad-accum", grad_accum, 150, _LM),
    regime("aux-term", aux_term, 300, _LM + " (the main head)"),
    regime("zero-warmup", zero_warmup, 300, _LM),
    regime("label-smoothing", label_smoothing, 300, _LM + " (no smoothing)"),
    regime("wd-only", wd_only, 300, _LM),
    regime("lora", lora, 300, _LM + " of prose"),
    regime("post-ln-finetune", post_ln_finetune, 300, _LM + " of prose"),
    regime("post-ln-scratch", post_ln_scratch, 300, _LM),
)
