"""What a healthy regime is made of: a model, its loss, its optimizer, its data, its eval.

Every regime builds a `Setup` for one seed; `RegimeModule` wraps it in a LightningModule that a
real ``Trainer`` trains. The data is a function of the epoch (Lightning calls the module's
``train_dataloader`` again each epoch under ``reload_dataloaders_every_n_epochs=1``, which is
how a staged run or a curriculum changes its data), and each item of a loader is a whole batch
drawn from a generator seeded by ``(seed, i)``: batch ``i`` is the same in every run of a seed,
with or without the monitor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

__all__ = ["Batches", "Regime", "RegimeModule", "Setup", "loader", "regime"]

Batch = Any
LossFn = Callable[[nn.Module, Batch, int], Tensor]
"""``(net, batch, global_step) -> loss``."""
OptimFn = Callable[[nn.Module], Any]
"""``net -> what configure_optimizers returns`` (an optimizer, or a dict with a scheduler)."""


class Batches(Dataset[Batch]):
    """Item ``i`` is ``make(np.random.default_rng((seed, i)), i)``: the whole batch of step ``i``.

    Use with ``DataLoader(batches, batch_size=None)`` (`loader`).
    """

    def __init__(
        self, make: Callable[[np.random.Generator, int], Batch], n: int, seed: int
    ) -> None:
        self.make, self.n, self.seed = make, n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Batch:
        return self.make(np.random.default_rng((self.seed, i)), i)


def loader(make: Callable[[np.random.Generator, int], Batch], n: int, seed: int) -> DataLoader[Any]:
    """A loader of ``n`` whole batches (see `Batches`), in order."""
    return DataLoader(Batches(make, n, seed), batch_size=None, shuffle=False)


@dataclass
class Setup:
    """One seed's run of a regime, ready to train.

    Args:
        net: The model (every parameter the optimizer holds lives in it).
        loss: ``(net, batch, global_step) -> loss``.
        optimizer: ``net -> configure_optimizers()``'s return value.
        data: ``epoch -> train loader``.
        evaluate: ``net -> float``, lower is better and > 0: the regime's final eval, computed
            in eval mode without gradients on data held out from training.
        trainer_args: ``Trainer`` arguments beyond the defaults (``accumulate_grad_batches``,
            ``reload_dataloaders_every_n_epochs``, ...).
    """

    net: nn.Module
    loss: LossFn
    optimizer: OptimFn
    data: Callable[[int], DataLoader[Any]]
    evaluate: Callable[[nn.Module], float]
    trainer_args: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Regime:
    """A healthy training regime: what it is, why it is healthy, and how to build it.

    Args:
        name: Short name (the benchmark's ``--regimes`` value).
        summary: One line: the regime, and what a monitor might mistake in it.
        steps: Default optimizer steps.
        eval_note: What the eval measures.
        build: ``(seed, steps) -> Setup``; steps at which the regime changes something (a new
            stage, a loss term switched on) are fractions of ``steps``.
    """

    name: str
    summary: str
    steps: int
    eval_note: str
    build: Callable[[int, int], Setup]


def regime(name: str, build: Callable[[int, int], Setup], steps: int, eval_note: str) -> Regime:
    """A `Regime` whose summary is the first paragraph of ``build``'s docstring."""
    summary = " ".join((build.__doc__ or "").split("\n\n")[0].split())
    return Regime(name, summary, steps, eval_note, build)


class RegimeModule(pl.LightningModule):
    """The LightningModule of a `Setup`: its loss in ``training_step``, its optimizer, its data."""

    def __init__(self, setup: Setup) -> None:
        super().__init__()
        self.net = setup.net
        self.setup_ = setup

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        return self.setup_.loss(self.net, batch, self.global_step)

    def configure_optimizers(self) -> Any:
        return self.setup_.optimizer(self.net)

    def train_dataloader(self) -> DataLoader[Any]:
        return self.setup_.data(self.trainer.current_epoch)

    @torch.no_grad()
    def evaluate(self) -> float:
        """The regime's final eval (``Setup.evaluate``) in eval mode."""
        was = self.net.training
        self.net.eval()
        try:
            return float(self.setup_.evaluate(self.net))
        finally:
            self.net.train(was)
