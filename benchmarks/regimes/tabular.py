"""Healthy regimes on synthetic tabular data: each a loss or a model whose numbers look odd.

Losses near 0 or near 1e8, negative losses, losses that change sign, a loss that never moves,
gradient norms far above 1, experts that get no tokens: all normal for the run that has them.
The data of a seed is drawn from generators seeded by the seed (the task itself, e.g. a
teacher's weights) and by ``(seed, step)`` (each batch).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import ConcatDataset, DataLoader

from .base import Batches, Regime, Setup, loader, regime
from .parts import warmup_cosine

__all__ = ["TABULAR_REGIMES"]

BATCH = 64


def _mlp(*sizes: int, dropout: float = 0.0) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers += [nn.ReLU(), *([nn.Dropout(dropout)] if dropout else [])]
    return nn.Sequential(*layers)


def _t(a: Any) -> Tensor:
    return torch.as_tensor(np.asarray(a, dtype=np.float32))


def _adam(lr: float, steps: int, warmup: int = 20) -> Any:
    def make(net: nn.Module) -> Any:
        opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=lr)
        return warmup_cosine(opt, warmup, steps)

    return make


def _held_eval(make: Any, seed: int, loss: Any, n: int = 8) -> Any:
    held = [make(np.random.default_rng((seed, 10**6 + i)), 10**6 + i) for i in range(n)]
    return lambda net: float(torch.stack([loss(net, b, 0) for b in held]).mean())


def _mse(net: nn.Module, batch: Any, step: int) -> Tensor:
    x, y = batch
    return F.mse_loss(net(x).squeeze(-1), y)


def _ce(net: nn.Module, batch: Any, step: int) -> Tensor:
    x, y = batch
    return F.cross_entropy(net(x), y)


class MoE(nn.Module):
    """Top-1 mixture of experts: the router picks one expert per row, scaled by its gate. The
    last half of the experts start with router bias -4, so they get (almost) no rows and their
    weights no gradient: idle experts, as a router without a balancing loss leaves them."""

    def __init__(self, d: int = 16, experts: int = 8, hidden: int = 32) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts)
        with torch.no_grad():
            self.router.bias[experts // 2 :] = -4.0
        self.experts = nn.ModuleList(_mlp(d, hidden, 1) for _ in range(experts))

    def forward(self, x: Tensor) -> Tensor:
        gates = self.router(x).softmax(-1)  # (B, E)
        top = gates.argmax(-1)  # (B,)
        out = x.new_zeros(x.size(0), 1)
        for e in top.unique().tolist():
            rows = (top == e).nonzero().squeeze(1)
            y = self.experts[e](x[rows]) * gates[rows, e : e + 1]  # (rows, 1)
            out = out.index_copy(0, rows, y)
        return out


def moe_idle(seed: int, steps: int) -> Setup:
    """MoE regression (8 experts, top-1) with 4 idle experts: a piecewise-linear teacher."""
    w = np.random.default_rng(seed).normal(size=(4, 16)) / 4

    def make(rng: np.random.Generator, i: int) -> Any:
        x = rng.normal(size=(BATCH, 16))
        piece = (x[:, 0] > 0) * 2 + (x[:, 1] > 0)
        return _t(x), _t(np.einsum("bd,bd->b", x, w[piece]) + 0.05 * rng.normal(size=BATCH))

    evaluate = _held_eval(make, seed, _mse)
    data = lambda epoch: loader(make, steps, seed + 1000 * epoch)  # noqa: E731
    return Setup(MoE(), _mse, _adam(3e-3, steps), data, evaluate)


def memorise(seed: int, steps: int) -> Setup:
    """An MLP memorises 128 random points' random labels (the same full batch every step): the
    loss falls to ~1e-4 and below, where a relative wobble is a large ratio."""
    rng = np.random.default_rng(seed)
    batch = _t(rng.normal(size=(128, 32))), torch.from_numpy(rng.integers(0, 10, 128))
    data = lambda epoch: loader(lambda r, i: batch, steps, seed)  # noqa: E731
    evaluate = lambda net: float(_ce(net, batch, 0))  # noqa: E731
    return Setup(_mlp(32, 256, 256, 10), _ce, _adam(3e-3, steps), data, evaluate)


def huge_scale(seed: int, steps: int) -> Setup:
    """Regression on prices in dollars (targets ~1e4, the net predicts in units of 1e4): the MSE
    starts near 1e8, the gradient norm near 1e7-1e8."""
    rng0 = np.random.default_rng(seed)
    a, b = rng0.normal(size=8), rng0.normal(size=8)

    def make(rng: np.random.Generator, i: int) -> Any:
        x = rng.normal(size=(BATCH, 8))
        price = 1e4 * (2 + x @ a / 3 + 0.5 * np.sin(x @ b)) + 300 * rng.normal(size=BATCH)
        return _t(x), _t(price)

    net = _mlp(8, 64, 64, 1)

    def loss(net: nn.Module, batch: Any, step: int) -> Tensor:
        x, y = batch
        return F.mse_loss(1e4 * net(x).squeeze(-1), y)

    data = lambda epoch: loader(make, steps, seed + 1000 * epoch)  # noqa: E731
    return Setup(net, loss, _adam(3e-3, steps), data, _held_eval(make, seed, loss))


def reinforce(seed: int, steps: int) -> Setup:
    """REINFORCE on a contextual bandit (4 arms, reward 1 with probability 0.9 on the best arm,
    0.1 on the others), a batch-mean baseline: the loss is noise around 0, of either sign."""
    w = _t(np.random.default_rng(seed).normal(size=(8, 4)))

    def make(rng: np.random.Generator, i: int) -> Any:
        x = _t(rng.normal(size=(BATCH, 8)))
        return x, (x @ w).argmax(-1), _t(rng.random((BATCH, 2)))  # uniforms: action, reward

    def loss(net: nn.Module, batch: Any, step: int) -> Tensor:
        x, best, u = batch
        logp = net(x).log_softmax(-1)  # (B, 4)
        action = (logp.exp().cumsum(-1) < u[:, :1]).sum(-1).clamp(max=3)  # sampled from pi
        reward = (u[:, 1] < torch.where(action == best, 0.9, 0.1)).float()
        chosen = logp.gather(1, action[:, None]).squeeze(1)
        surrogate: Tensor = -((reward - reward.mean()) * chosen).mean()
        return surrogate

    def regret(net: nn.Module, batch: Any, step: int) -> Tensor:
        x, best, _ = batch
        return F.cross_entropy(net(x), best)  # -log pi(best arm)

    data = lambda epoch: loader(make, steps, seed + 1000 * epoch)  # noqa: E731
    return Setup(_mlp(8, 64, 4), loss, _adam(3e-3, steps), data, _held_eval(make, seed, regret))


def _blobs(seed: int, d: int, spread: float, noise: float = 0.0) -> Any:
    centres = np.random.default_rng(seed).normal(size=(10, d))

    def make(rng: np.random.Generator, i: int) -> Any:
        y = rng.integers(0, 10, BATCH)
        x = centres[y] + spread * rng.normal(size=(BATCH, d))
        flip = (rng.random(BATCH) < noise) & (i < 10**6)  # held-out batches keep clean labels
        return _t(x), torch.from_numpy(np.where(flip, rng.integers(0, 10, BATCH), y))

    return make


def dropout_noisy(seed: int, steps: int) -> Setup:
    """An MLP with dropout 0.5 after each hidden layer on 10 overlapping classes, 40% of the
    training labels random: every batch's loss is noisy and high."""
    make = _blobs(seed, 20, 1.0, noise=0.4)
    data = lambda epoch: loader(make, steps, seed + 1000 * epoch)  # noqa: E731
    net = _mlp(20, 256, 256, 10, dropout=0.5)
    return Setup(net, _ce, _adam(1e-3, steps), data, _held_eval(make, seed, _ce))


def frozen_constant(seed: int, steps: int) -> Setup:
    """A dry run of a frozen model: the trunk frozen, the head's LR 0, the same batch every
    step: the loss is the same number at every step, and the gradient too."""
    rng = np.random.default_rng(seed)
    batch = _t(rng.normal(size=(BATCH, 20))), torch.from_numpy(rng.integers(0, 10, BATCH))
    net = _mlp(20, 64, 10)
    net[0].requires_grad_(False)

    def optimizer(net: nn.Module) -> Any:
        return torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.0)

    data = lambda epoch: loader(lambda r, i: batch, steps, seed)  # noqa: E731
    return Setup(net, _ce, optimizer, data, lambda net: float(_ce(net, batch, 0)))


def gaussian_nll(seed: int, steps: int) -> Setup:
    """A Gaussian NLL head (mean and log-variance) on heteroscedastic data: the loss goes
    negative as the variance fits, and the gradient norm stays well above 1."""
    rng0 = np.random.default_rng(seed)
    a, b = rng0.normal(size=8), rng0.normal(size=8) / 3

    def make(rng: np.random.Generator, i: int) -> Any:
        x = rng.normal(size=(BATCH, 8))
        std = 0.05 + 0.3 * np.abs(x[:, 0])
        return _t(x), _t(3 * np.sin(x @ a / 3) + x @ b + std * rng.normal(size=BATCH))

    def loss(net: nn.Module, batch: Any, step: int) -> Tensor:
        x, y = batch
        mean, logvar = net(x).unbind(-1)
        nll: Tensor = (0.5 * (logvar + (y - mean) ** 2 * torch.exp(-logvar))).mean()
        return nll

    nll = _held_eval(make, seed, loss)
    data = lambda epoch: loader(make, steps, seed + 1000 * epoch)  # noqa: E731
    return Setup(_mlp(8, 128, 128, 2), loss, _adam(1e-3, steps), data, lambda n: math.exp(nll(n)))


def sgdr(seed: int, steps: int) -> Setup:
    """SGD with momentum under ``CosineAnnealingWarmRestarts`` (SGDR, 4 cycles) on labels from
    a random tanh teacher network, inputs of std 3: the LR jumps back to its peak every quarter of
    the run, the loss bumps ~1.7x with it, and the gradient norm sits at 1.5-3."""
    torch.manual_seed(seed)
    teacher = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10)).requires_grad_(False)

    def make(rng: np.random.Generator, i: int) -> Any:
        x = _t(rng.normal(size=(BATCH, 32)))
        return 3 * x, teacher(x).argmax(-1)

    def optimizer(net: nn.Module) -> Any:
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        restarts = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, max(1, steps // 4))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": restarts, "interval": "step"}}

    data = lambda epoch: loader(make, steps, seed + 1000 * epoch)  # noqa: E731
    return Setup(_mlp(32, 256, 256, 10), _ce, optimizer, data, _held_eval(make, seed, _ce))


def _two_tasks(seed: int) -> tuple[Any, Any]:
    """Task A: 10 blob classes; task B: the same inputs, the classes relabelled (a new task
    that the first one's answers get wrong with confidence)."""
    make_a = _blobs(seed, 20, 1.0)
    relabel = torch.from_numpy(np.random.default_rng(seed + 7).permutation(10))

    def make_b(rng: np.random.Generator, i: int) -> Any:
        x, y = make_a(rng, i)
        return x, relabel[y]

    return make_a, make_b


def new_task(seed: int, steps: int) -> Setup:
    """Blob classification, then a new task on a new loader halfway (the classes relabelled,
    epoch 1): the loss jumps far above its chance level (the first task's answers are wrong
    with confidence), then falls at the run's usual rate to the new task's level."""
    make_a, make_b = _two_tasks(seed)
    half = max(1, steps // 2)

    def data(epoch: int) -> Any:
        return loader(make_a if epoch == 0 else make_b, half, seed + 1000 * epoch)

    setup = Setup(_mlp(20, 128, 10), _ce, _adam(3e-3, steps), data, _held_eval(make_b, seed, _ce))
    return Setup(**{**vars(setup), "trainer_args": {"reload_dataloaders_every_n_epochs": 1}})


def new_task_internal(seed: int, steps: int) -> Setup:
    """The same two tasks in one loader (an unshuffled concatenation: the run does not say
    where the second task begins)."""
    make_a, make_b = _two_tasks(seed)
    half = max(1, steps // 2)
    stages = [Batches(make_a, half, seed), Batches(make_b, steps - half, seed + 1)]

    def data(epoch: int) -> Any:
        return DataLoader(ConcatDataset(stages), batch_size=None, shuffle=False)

    return Setup(_mlp(20, 128, 10), _ce, _adam(3e-3, steps), data, _held_eval(make_b, seed, _ce))


TABULAR_REGIMES: tuple[Regime, ...] = (
    regime("moe-idle", moe_idle, 400, "held-out MSE"),
    regime("memorise", memorise, 400, "cross-entropy on the memorised set"),
    regime("huge-scale", huge_scale, 400, "held-out MSE (dollars squared)"),
    regime("reinforce", reinforce, 400, "held-out -log pi(best arm)"),
    regime("dropout-noisy", dropout_noisy, 400, "held-out cross-entropy, clean labels"),
    regime("frozen-constant", frozen_constant, 300, "the batch's cross-entropy"),
    regime("gaussian-nll", gaussian_nll, 400, "exp(held-out Gaussian NLL)"),
    regime("sgdr", sgdr, 400, "held-out cross-entropy"),
    regime("new-task", new_task, 240, "held-out cross-entropy on the second task"),
    regime("new-task-internal", new_task_internal, 240, "held-out cross-entropy, second task"),
)
