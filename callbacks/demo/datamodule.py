"""``StabilizerDataModule``: batches of the byte-level corpus for the reference GPT."""

from __future__ import annotations

from collections.abc import Container
from pathlib import Path

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from stabilizer.demo.data import Corpus, RandomWindows, load_corpus

__all__ = ["StabilizerDataModule"]


class StabilizerDataModule(pl.LightningDataModule):
    """Deterministic random windows of the stdlib corpus (or the user's text file).

    Batch ``i`` of training is the same on every run (see
    :class:`~stabilizer.demo.data.RandomWindows`); validation is a fixed set of ``val_batches``
    batches.

    Args:
        block_size: Tokens per training window; the model's context length.
        batch_size: Windows per batch.
        max_steps: Number of training batches (one per optimizer step).
        data: A text file to train on instead of the stdlib corpus.
        cache_dir: Corpus cache location (default: ``stabilizer.demo.data.default_cache_dir()``).
        seed: Seed of the window positions.
        corrupt: Training batch indices replaced by bad data (the spike scenarios).
        corrupt_fill: What replaces them: ``"random"`` bytes or ``"zeros"`` (NUL bytes).
        val_batches: Number of validation batches.
    """

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 16,
        max_steps: int = 1000,
        data: str | Path | None = None,
        cache_dir: str | Path | None = None,
        seed: int = 0,
        corrupt: Container[int] | None = None,
        val_batches: int = 8,
        corrupt_fill: str = "random",
    ) -> None:
        super().__init__()
        self.block_size, self.batch_size, self.max_steps = block_size, batch_size, max_steps
        self.data, self.cache_dir, self.seed = data, cache_dir, seed
        self.corrupt, self.val_batches = corrupt, val_batches
        self.corrupt_fill = corrupt_fill
        self.corpus: Corpus | None = None

    def prepare_data(self) -> None:
        load_corpus(self.data, self.cache_dir)  # builds the cache once, on one process

    def setup(self, stage: str) -> None:
        self.corpus = load_corpus(self.data, self.cache_dir)

    def train_dataloader(self) -> DataLoader[tuple]:  # type: ignore[type-arg]
        assert self.corpus is not None, "setup() runs before the dataloaders"
        windows = RandomWindows(
            self.corpus.train,
            self.block_size,
            self.batch_size,
            self.max_steps,
            seed=self.seed,
            corrupt=self.corrupt,
            fill=self.corrupt_fill,
        )
        return DataLoader(windows, batch_size=None, shuffle=False)

    def val_dataloader(self) -> DataLoader[tuple]:  # type: ignore[type-arg]
        assert self.corpus is not None, "setup() runs before the dataloaders"
        windows = RandomWindows(
            self.corpus.val, self.block_size, self.batch_size, self.val_batches, seed=self.seed + 1
        )
        return DataLoader(windows, batch_size=None, shuffle=False)
