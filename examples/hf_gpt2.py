"""The monitor on a Hugging Face ``GPT2LMHeadModel`` in a plain LightningModule.

    pip install -e ".[hf]"        # transformers
    python examples/hf_gpt2.py --steps 40 --nan-at 20

A small GPT-2 built from a ``GPT2Config`` (random weights: nothing is downloaded, the hub is never
asked), trained on the byte-level stdlib corpus the reference GPT uses. The monitor groups GPT-2's
parameters by depth (``transformer.wte``/``wpe`` embed, ``transformer.h.N`` block_NN, ``ln_f``
head; ``lm_head`` is tied to ``wte``) and checks at the first batch that the model is causal. With
``--nan-at`` the MLP of block 1 outputs NaN at that step: the monitor reports it, skips the step
(weights intact) and names ``transformer.h.1.mlp``; ``stabilizer diagnose <log_dir>`` explains it
later.
"""

from __future__ import annotations

import argparse
import os

# Nothing here needs the hub; say so before transformers reads its settings.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from transformers import GPT2Config, GPT2LMHeadModel

from stabilizer import StabilityMonitor, StabilizerDataModule
from stabilizer.demo.data import VOCAB_SIZE

BLOCK_SIZE = 64


class LitHFGPT2(pl.LightningModule):
    """GPT-2 from a config, trained on next-byte prediction."""

    def __init__(self, nan_at: int = -1) -> None:
        super().__init__()
        self.nan_at = nan_at
        config = GPT2Config(
            vocab_size=VOCAB_SIZE,  # byte-level tokens
            n_positions=BLOCK_SIZE,
            n_embd=64,
            n_layer=4,
            n_head=4,
            bos_token_id=0,  # GPT-2's 50256 is outside a 256-token vocabulary
            eos_token_id=0,
        )
        self.model = GPT2LMHeadModel(config)
        self.model.get_submodule("transformer.h.1.mlp").register_forward_hook(self._fault)

    def _fault(self, module: nn.Module, args: object, out: Tensor) -> Tensor | None:
        if module.training and self.global_step == self.nan_at:
            return out * float("nan")  # an overflow in one MLP, for the demonstration
        return None

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids=input_ids).logits  # type: ignore[no-any-return]

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch  # (B, T) each; y is x shifted by one byte
        logits = self(x)  # (B, T, vocab)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB_SIZE), y.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--nan-at", type=int, default=-1, help="step whose block-1 MLP goes NaN")
    parser.add_argument("--log-dir", default="runs/hf_gpt2")
    args = parser.parse_args()
    torch.manual_seed(0)
    data = StabilizerDataModule(block_size=BLOCK_SIZE, batch_size=8, max_steps=args.steps)
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
    trainer.fit(LitHFGPT2(nan_at=args.nan_at), data)


if __name__ == "__main__":
    main()
