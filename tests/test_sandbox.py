"""`sandbox`: what runs inside leaves gradients, buffers, attributes and RNG as they were."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn

from stabilizer.live.sandbox import sandbox
from stabilizer.step.weights import BufferWatch


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(3, 3), nn.BatchNorm1d(3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.norm(self.lin(x))


def test_sandbox_puts_everything_back() -> None:
    model = Counting()
    model(torch.randn(4, 3)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    copies = [g.clone() for g in grads if g is not None]
    stats = [b.clone() for b in model.buffers()]
    states = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    with sandbox(model) as box:
        model.eval()
        model.train()
        model(torch.randn(4, 3) * 1e3).sum().backward()  # new stats, new grads, RNG drawn
        torch.rand(5)
        np.random.rand(3)
        random.random()
        model.lin.weight.requires_grad_(False)
    assert box.changed == []
    assert model.calls == 1 and model.training
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))  # same objects
    assert all(
        torch.equal(a, b) for a, b in zip(copies, [g for g in grads if g is not None], strict=True)
    )
    assert all(torch.equal(a, b) for a, b in zip(stats, model.buffers(), strict=True))
    assert model.lin.weight.requires_grad
    assert torch.equal(torch.get_rng_state(), states[0])
    assert (np.random.get_state()[1] == states[1]).all() and random.getstate() == states[2]


def test_sandbox_names_a_parameter_written_in_place() -> None:
    model = Counting()
    with sandbox(model) as box, torch.no_grad():
        model.lin.bias.add_(1.0)
    assert box.changed == ["lin.bias"]


class LateStatistic(nn.Module):
    """A running statistic refreshed in place only from its fourth call on."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("stat", torch.zeros(2))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls >= 4:
            with torch.no_grad():
                self.stat.mul_(0.5).add_(x.mean(0))
        return x


def test_buffer_watch_restores_every_buffer_whenever_it_first_changes() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), LateStatistic())
    model.register_buffer("fixed", torch.ones(3))
    watch = BufferWatch(model)
    for _ in range(4):  # the late statistic changes for the first time at the fourth step
        watch.begin()
        model(torch.randn(4, 2))
        watch.end(restore=False)
    before = [b.clone() for b in model.buffers()]
    watch.begin()
    model(torch.full((4, 2), float("nan")))  # a NaN batch: every statistic goes NaN
    watch.end(restore=True)
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers(), strict=True))


def test_buffer_watch_sees_modules_and_buffers_registered_mid_run() -> None:
    # The watch keeps its walk over the modules between steps; any registration renews it.
    model = nn.Sequential(nn.Linear(2, 2))
    watch = BufferWatch(model)
    watch.begin()
    assert watch.buffers == []
    watch.end(restore=False)
    model.append(nn.BatchNorm1d(2))  # a submodule with buffers, added mid-run
    model[0].register_buffer("scale", torch.ones(1))  # a buffer on a module that had none
    watch.begin()
    assert {id(b) for _, b in watch.buffers} == {id(b) for b in model.buffers()}
    model(torch.full((4, 2), float("nan")))
    watch.end(restore=True)
    assert all(bool(torch.isfinite(b.float()).all()) for b in model.buffers())


def test_buffer_watch_restores_a_buffer_resized_in_place() -> None:
    # A per-channel observer's min/max start empty and are resized on their first batch.
    model = nn.Module()
    model.register_buffer("amin", torch.tensor([]))
    watch = BufferWatch(model)
    watch.begin()
    model.amin.resize_(3).fill_(float("nan"))
    watch.end(restore=True)
    assert model.amin.shape == (0,)
