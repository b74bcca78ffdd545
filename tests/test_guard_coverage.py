"""The guard sees every tensor the optimizer updates, whenever it starts being updated.

Each test trains a small real model with a real Trainer and puts a NaN/Inf into the gradient of
a tensor the guard could miss: a backbone unfrozen mid-run (Lightning's ``BackboneFinetuning``),
a sparse embedding gradient, a parameter added to the optimizer mid-run, a tensor the optimizer
holds that is no module parameter. The loss stays finite: only the gradient check can catch it.
At the bad step the optimizer's tensors and state must stay bit-for-bit as they were.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from stabilizer.callbacks.monitor import StabilityMonitor
from stabilizer.live.tensors import optimizer_state_tensors

VOCAB = 32


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Tiny models: one torch thread."""


class Net(pl.LightningModule):
    """Embedding, a backbone, a head: next-token-ish classification of random tokens."""

    def __init__(self, sparse: bool = False, sgd: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16, sparse=sparse)
        self.backbone = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, VOCAB)
        self.sgd = sgd
        self.loose: Tensor | None = None  # an optimizer tensor that is no module parameter

    def forward(self, x: Tensor) -> Tensor:
        h = self.backbone(self.embed(x))
        if self.loose is not None:
            h = h * self.loose
        out: Tensor = self.head(h)
        return out

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.loose is not None:
            params.append(self.loose)
        if self.sgd:
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)

    def train_dataloader(self) -> DataLoader[tuple[Tensor, ...]]:
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, VOCAB, (64,), generator=g)
        return DataLoader(TensorDataset(x, (x * 7 + 3) % VOCAB), batch_size=8)


def _optimizer_tensors(trainer: pl.Trainer) -> list[Tensor]:
    opt = trainer.optimizers[0]
    params = [p for g in opt.param_groups for p in g["params"]]
    tensors = [*params, *optimizer_state_tensors(opt)]
    return [(t.to_dense() if t.is_sparse else t).detach().clone() for t in tensors]


class BadGrad(pl.Callback):
    """Multiplies the gradient of ``target(module)`` by ``value`` at optimizer step ``step``.

    Records whether the optimizer's tensors and state came out of that step bit-for-bit equal.
    """

    def __init__(self, target: Callable[[Any], Tensor], step: int, value: float) -> None:
        self.target, self.step, self.value = target, step, value
        self.handle: Any = None
        self.before: list[Tensor] = []
        self.untouched: bool | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.before = _optimizer_tensors(trainer)
            value = self.value
            self.handle = self.target(pl_module).register_hook(lambda g: g * value)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
            after = _optimizer_tensors(trainer)
            self.untouched = len(after) == len(self.before) and all(
                torch.equal(a, b) for a, b in zip(self.before, after, strict=True)
            )


def fit(module: Net, steps: int, *callbacks: pl.Callback) -> StabilityMonitor:
    monitor = StabilityMonitor(jsonl=False, preflight=False, activation_every=0)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, callbacks=[*callbacks, monitor], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)
    return monitor


def assert_protected(module: Net, bad: BadGrad, monitor: StabilityMonitor) -> None:
    assert bad.untouched is True, "the bad step changed the optimizer's tensors"
    for name, p in module.named_parameters():
        assert torch.isfinite(p).all(), f"{name} is not finite"
    assert monitor.guard is not None and monitor.guard.skipped == 1
    assert any(f.kind == "nonfinite_grad" for f in monitor.findings)


def test_backbone_unfrozen_mid_run_is_guarded() -> None:
    # Epochs of 8 steps; the backbone joins the optimizer at epoch 1 (step 8), Inf at step 10.
    module = Net()
    bad = BadGrad(lambda m: m.backbone[0].weight, step=10, value=math.inf)
    monitor = fit(module, 14, BackboneFinetuning(unfreeze_backbone_at_epoch=1), bad)
    assert_protected(module, bad, monitor)


def test_sparse_embedding_gradient_is_checked_exactly(caplog: pytest.LogCaptureFixture) -> None:
    module = Net(sparse=True, sgd=True)
    bad = BadGrad(lambda m: m.embed.weight, step=10, value=math.nan)
    with caplog.at_level(logging.WARNING):
        monitor = fit(module, 14, bad)
    assert_protected(module, bad, monitor)
    said = [r for r in caplog.records if "fast path cannot run" in r.getMessage()]
    assert not said  # a sparse gradient's stored values are read on the fast path


class AddParam(pl.Callback):
    """At step 3, gives the module a new parameter and hands it to the optimizer."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == 3:
            pl_module.loose_param = nn.Parameter(torch.ones(16))
            trainer.optimizers[0].add_param_group({"params": [pl_module.loose_param]})
            pl_module.loose = pl_module.loose_param


def test_param_group_added_mid_run_is_guarded() -> None:
    module = Net()
    bad = BadGrad(lambda m: m.loose_param, step=6, value=math.inf)
    monitor = fit(module, 9, AddParam(), bad)
    assert_protected(module, bad, monitor)


def test_optimizer_tensor_that_is_no_module_parameter_is_guarded() -> None:
    module = Net()
    module.loose = torch.ones(16, requires_grad=True)  # a plain tensor: not in parameters()
    bad = BadGrad(lambda m: m.loose, step=5, value=math.inf)
    monitor = fit(module, 8, bad)
    assert_protected(module, bad, monitor)
    assert torch.isfinite(module.loose).all()
