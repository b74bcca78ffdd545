"""``LitGPT``: the reference GPT as a LightningModule (AdamW or SGD with momentum, LR warmup then
cosine decay)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import lightning.pytorch as pl
import torch

from stabilizer.demo.model import GPT, GPTConfig
from stabilizer.demo.scenarios import OPTIMIZERS
from stabilizer.step.swap import restore_pre_ln

__all__ = ["LitGPT", "warmup_cosine"]


def warmup_cosine(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier at ``step``: linear warmup to 1 over ``warmup_steps`` (0 allowed), then a
    cosine decay to ``min_lr_ratio`` at ``max_steps`` (and flat after it)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class LitGPT(pl.LightningModule):
    """The reference GPT trained with AdamW (or SGD) and a per-step warmup + cosine schedule.

    Logs ``train/loss`` every step and ``val/loss`` per validation run.

    Args:
        config: The model's configuration (a dict when loaded back from a checkpoint).
        lr: Peak learning rate.
        weight_decay: Weight decay (AdamW's decoupled one, SGD's L2), applied to matrices
            (weights, embeddings) only, not to biases and norm gains, as in nanoGPT.
        betas: AdamW betas.
        eps: AdamW epsilon.
        optimizer: ``"adamw"``, or ``"sgd"``: SGD with heavy-ball momentum, whose step is the
            LR times the gradient (so an outsized gradient is an outsized step).
        momentum: SGD's momentum (unused by AdamW).
        warmup_steps: Linear warmup length in optimizer steps; 0 for none.
        max_steps: Where the cosine reaches ``min_lr_ratio * lr``.
        min_lr_ratio: Final LR as a fraction of ``lr``.
    """

    def __init__(
        self,
        config: GPTConfig | dict[str, Any] | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 0,
        max_steps: int = 1000,
        min_lr_ratio: float = 0.1,
        optimizer: str = "adamw",
        momentum: float = 0.9,
    ) -> None:
        super().__init__()
        if lr <= 0:
            raise ValueError(f"`lr` must be > 0, got {lr}")
        if optimizer not in OPTIMIZERS:
            choices = ", ".join(OPTIMIZERS)
            raise ValueError(f"`optimizer` must be one of {choices}, got {optimizer!r}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"`momentum` must be in [0, 1), got {momentum}")
        if warmup_steps < 0:
            raise ValueError(f"`warmup_steps` must be >= 0, got {warmup_steps}")
        if max_steps < 1:
            raise ValueError(f"`max_steps` must be >= 1, got {max_steps}")
        if isinstance(config, dict):
            config = GPTConfig(**config)
        self.config = config or GPTConfig()
        self.save_hyperparameters(ignore=["config"])
        # A plain dict, so checkpoints and hparams.yaml hold no pickled classes.
        self.hparams["config"] = dataclasses.asdict(self.config)
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, betas, eps
        self.warmup_steps, self.max_steps, self.min_lr_ratio = warmup_steps, max_steps, min_lr_ratio
        self.optimizer_name, self.momentum = optimizer, momentum
        self.model = GPT(self.config)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # a checkpoint of an `auto` run that moved the model to pre-LN loads into a pre-LN GPT
        restore_pre_ln(self, checkpoint)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model(idx)[0]
        return logits

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        x, y = batch
        _, loss = self.model(x, y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        _, loss = self.model(x, y)
        self.log("val/loss", loss, prog_bar=True)

    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": self.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        optimizer: torch.optim.Optimizer
        if self.optimizer_name == "sgd":
            optimizer = torch.optim.SGD(groups, lr=self.lr, momentum=self.momentum)
        else:
            optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=self.betas, eps=self.eps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: warmup_cosine(step, self.warmup_steps, self.max_steps, self.min_lr_ratio),
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }
