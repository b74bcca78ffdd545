"""Healthy training regimes: what a stability monitor must leave as it found them (issue #31).

Each regime is a real run that learns and never fails, but whose numbers a monitor could take
for a failure: a new stage's loss level, a loss exactly 0 or near 1e8 or negative, a gradient
norm far above 1, a post-LN model with no warmup, frozen or pretrained weights. `train_regime`
trains one with a real Lightning ``Trainer`` on the CPU; ``benchmarks/harm.py`` trains each
without the monitor, with ``protect`` and with ``auto``, and says what the monitor changed.

    from benchmarks.regimes import train_regime
    run = train_regime("staged", seed=0, callbacks=[StabilityMonitor(policy="auto")])
    run.eval, run.trainer.global_step
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import lightning.pytorch as pl
import torch

from .base import Regime, RegimeModule, Setup
from .tabular import TABULAR_REGIMES
from .text import TEXT_REGIMES

__all__ = ["REGIMES", "Regime", "RegimeModule", "RegimeRun", "Setup", "get_regime", "train_regime"]

_ORDER = (
    # the eight that held in #31's trials
    "moe-idle", "memorise", "huge-scale", "curriculum", "reinforce", "dropout-noisy", "wd-only",
    "frozen-constant",
    # the six it harmed (the second stage two ways)
    "post-ln-finetune", "post-ln-scratch", "staged", "staged-internal", "zero-warmup",
    "gaussian-nll", "sgdr",
    # more of the same families
    "aux-term", "label-smoothing", "grad-accum", "lora",
    # round 5 (#39): a second stage that is a new task, on a new loader and inside one
    "new-task", "new-task-internal",
)  # fmt: skip
_ALL = {r.name: r for r in (*TABULAR_REGIMES, *TEXT_REGIMES)}
REGIMES: dict[str, Regime] = {name: _ALL[name] for name in _ORDER}
"""Every regime by name: the eight that held in #31's trials, the six it harmed, then more."""


def get_regime(name: str) -> Regime:
    """The regime called ``name``; an unknown name lists the valid ones."""
    try:
        return REGIMES[name]
    except KeyError:
        raise ValueError(f"unknown regime {name!r}; choose one of {', '.join(REGIMES)}") from None


@dataclass
class RegimeRun:
    """A finished run: its trainer, its module, its final eval and whether its weights are
    finite."""

    regime: Regime
    trainer: pl.Trainer
    module: RegimeModule
    eval: float
    finite: bool


def train_regime(
    name: str, seed: int = 0, steps: int | None = None, callbacks: Sequence[pl.Callback] = ()
) -> RegimeRun:
    """Train regime ``name`` for ``steps`` optimizer steps (default: its own) on the CPU.

    Everything but the regime's own settings is switched off (no logger, checkpoints, progress
    bar, validation loop): the eval is the regime's own, computed after the fit.
    """
    regime = get_regime(name)
    steps = regime.steps if steps is None else steps
    if steps < 1:
        raise ValueError(f"`steps` must be >= 1, got {steps}")
    pl.seed_everything(seed, verbose=False)
    setup = regime.build(seed, steps)
    module = RegimeModule(setup)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        max_epochs=-1,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        **dict(setup.trainer_args),
    )
    trainer.fit(module)
    finite = all(bool(torch.isfinite(p).all()) for p in module.parameters())
    value = module.evaluate() if finite else math.nan
    return RegimeRun(regime, trainer, module, value, finite)
