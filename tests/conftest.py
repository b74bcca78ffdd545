"""Shared fixtures: each failure scenario is trained once per test session, for real."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from stabilizer.callbacks.demo.run import ScenarioRun, run_scenario
from stabilizer.callbacks.monitor import StabilityMonitor


@dataclass
class Trace(pl.Callback):
    """Records, per optimizer step, the unscaled loss and each block's gradient norm.

    A plain measuring callback for the scenario tests: the quantities the failures are defined by.
    """

    loss: list[float] = field(default_factory=list)
    block_norms: list[list[float]] = field(default_factory=list)
    loss_scale: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    _loss: float = math.nan

    def on_before_backward(self, trainer: pl.Trainer, pl_module: Any, loss: torch.Tensor) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        scale = float(scaler.get_scale()) if scaler is not None else 1.0
        self._loss = float(loss.detach().float()) / scale  # under fp16 the loss is scaled here
        self.loss_scale.append(scale)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        norms = [
            math.sqrt(
                sum(float(p.grad.float().norm()) ** 2 for p in b.parameters() if p.grad is not None)
            )
            for b in pl_module.model.blocks
        ]
        self.block_norms.append(norms)
        self.lr.append(float(optimizer.param_groups[0]["lr"]))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.loss.append(self._loss)


@dataclass
class TracedRun:
    """A scenario trained with the ``Trace`` and an observing ``StabilityMonitor`` attached."""

    run: ScenarioRun
    trace: Trace
    monitor: StabilityMonitor
    log_dir: Path  # TensorBoard event files and stability.jsonl


_CACHE: dict[str, TracedRun] = {}


@pytest.fixture(scope="session")
def scenario_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], TracedRun]:
    """``scenario_run(name)`` trains the preset once per session and returns the traced run.

    The monitor observes only: these runs show each failure as it happens without protection
    (``test_protect.py`` and ``test_auto.py`` train with the other policies).
    """

    def get(name: str) -> TracedRun:
        if name not in _CACHE:
            trace, monitor = Trace(), StabilityMonitor(policy="observe")
            root = tmp_path_factory.mktemp(name)
            logger = TensorBoardLogger(save_dir=str(root), name=name)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run = run_scenario(
                    name, accelerator="cpu", callbacks=[trace, monitor], logger=logger
                )
            _CACHE[name] = TracedRun(run, trace, monitor, Path(logger.log_dir))
        return _CACHE[name]

    return get


@pytest.fixture(autouse=True, scope="session")
def _quiet_lightning() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread for a module of tiny models: they gain nothing from threads, and on a
    busy shared CPU the intra-op thread pool slows a training step down by ~50x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
