"""The monitor on your own LightningModule: one line in the Trainer's callbacks.

    python examples/own_module.py --steps 40 --nan-at 20

A small LM of your own (an embedding, residual blocks, a head). With ``--nan-at`` its loss goes
NaN at that step: the monitor says so on the console, skips the step (weights intact) and names
where the NaN came from; ``stabilizer diagnose <log_dir>`` explains it later (without a logger
the monitor writes ``<log_dir>/stability_logs/version_N/stability.jsonl``, one per run).
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from stabilizer import StabilityMonitor

VOCAB = 64


class MyLM(pl.LightningModule):
    def __init__(self, depth: int = 4, nan_at: int = -1) -> None:
        super().__init__()
        self.nan_at = nan_at
        self.emb = nn.Embedding(VOCAB, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(depth))
        self.ln_f = nn.LayerNorm(32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.emb(ids)  # (B, T, 32)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        logits: Tensor = self.head(self.ln_f(x))  # (B, T, VOCAB)
        return logits

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        (ids,) = batch
        logits = self(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        if self.global_step == self.nan_at:
            loss = loss * float("nan")  # a bug in the loss, for the demonstration
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--nan-at", type=int, default=-1, help="step whose loss goes NaN")
    parser.add_argument("--log-dir", default="runs/own_module")
    args = parser.parse_args()
    torch.manual_seed(0)
    data = TensorDataset(torch.randint(0, VOCAB, (args.steps * 8, 16)))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=args.steps,
        default_root_dir=args.log_dir,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        gradient_clip_val=1.0,
        callbacks=[StabilityMonitor()],  # the one line
    )
    trainer.fit(MyLM(nan_at=args.nan_at), DataLoader(data, batch_size=8))


if __name__ == "__main__":
    main()
