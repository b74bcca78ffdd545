"""The Stabilizer in a Hugging Face ``Trainer``: one callback in its list.

    pip install -e ".[hf]"        # transformers
    python examples/hf_trainer.py --steps 40 --nan-at 20

A small GPT-2 built from a ``GPT2Config`` (random weights: nothing is downloaded, the hub is
never asked), trained by ``transformers.Trainer`` on the byte-level stdlib corpus the reference
GPT uses (a byte is a token), with gradient accumulation. ``StabilityCallback()`` guards the
optimizer the Trainer steps and writes ``stability.jsonl`` to the output dir. With ``--nan-at``
the MLP of block 1 outputs NaN at that step: the step is skipped (weights intact) and
``transformer.h.1.mlp`` is named; HF's own logs go on as they do.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator

# Nothing here needs the hub; say so before transformers reads its settings.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch import Tensor, nn
from torch.utils.data import IterableDataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.utils import logging as hf_logging

from stabilizer import StabilityCallback
from stabilizer.demo.data import VOCAB_SIZE, RandomWindows, load_corpus

BLOCK_SIZE = 64


class Windows(IterableDataset[dict[str, Tensor]]):
    """The corpus's windows in order, one example each (the Trainer batches them)."""

    def __init__(self, count: int) -> None:
        self.windows = RandomWindows(load_corpus().train, BLOCK_SIZE, 8, count, seed=0)

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        for i in range(len(self.windows)):
            for ids in self.windows[i][0]:  # the model shifts the labels itself
                yield {"input_ids": ids, "labels": ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--nan-at", type=int, default=-1, help="step whose block-1 MLP goes NaN")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--log-dir", default="runs/hf_trainer")
    args = parser.parse_args()
    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # its notices; not its logs
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB_SIZE, n_positions=BLOCK_SIZE, n_embd=64, n_layer=4, n_head=4,
        bos_token_id=0, eos_token_id=0,  # GPT-2's 50256 is outside a 256-token vocabulary
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    trainer: Trainer | None = None

    def fault(module: nn.Module, inputs: object, out: Tensor) -> Tensor | None:
        step = trainer.state.global_step if trainer is not None else -1
        return out * float("nan") if module.training and step == args.nan_at else None

    model.get_submodule("transformer.h.1.mlp").register_forward_hook(fault)
    training = TrainingArguments(
        output_dir=args.log_dir, max_steps=args.steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=args.accumulate, learning_rate=1e-3,
        lr_scheduler_type="constant", max_grad_norm=1.0, logging_steps=10, report_to="none",
        save_strategy="no", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=training, train_dataset=Windows(args.steps * args.accumulate // 2),
        callbacks=[StabilityCallback()],  # the one line
    )  # fmt: skip
    trainer.train()


if __name__ == "__main__":
    main()
