"""Every optimizer torch and transformers ship runs healthy under ``protect`` (#38).

A plain loop (`Stabilizer`) trains a tiny model ten steps with each one, at its defaults (the
ones that need an LR get one): no step skipped, no non-finite finding, every step recorded, and
the weights end bit-identical to the same loop without the monitor. Where the guard cannot read
a setup (an optimizer that computes its own LR) it says so and lets the step through as
written. LBFGS, which evaluates its closure itself, has its own cases in the fault matrix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from stabilizer.hosts.loop import Stabilizer

NAN = {"nonfinite_loss", "nonfinite_grad", "nonfinite_update", "guard_error"}
STEPS = 10


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Tiny models: one torch thread (see conftest)."""


class Net(nn.Module):
    """An embedding (sparse gradients for SparseAdam) and two 2-D weights (Muon's)."""

    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8, sparse=sparse)
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 1, bias=False)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.b(torch.relu(self.a(self.embed(ids).mean(1)))) - y) ** 2).mean()


def _adafactor_hf(params: Any) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=None, relative_step=True, scale_parameter=True, warmup_init=True)


def _torch(name: str, **kwargs: Any) -> Callable[[Any], torch.optim.Optimizer]:
    def make(params: Any) -> torch.optim.Optimizer:
        optimizer: torch.optim.Optimizer = getattr(torch.optim, name)(params, **kwargs)
        return optimizer

    return make


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "SGD": _torch("SGD", lr=0.01),
    "SGD-momentum-nesterov": _torch("SGD", lr=0.01, momentum=0.9, nesterov=True),
    "Adam": _torch("Adam"),
    "Adam-amsgrad": _torch("Adam", amsgrad=True),
    "AdamW": _torch("AdamW"),
    "AdamW-fused": _torch("AdamW", fused=True),
    "Adamax": _torch("Adamax"),
    "NAdam": _torch("NAdam"),
    "RAdam": _torch("RAdam"),
    "RMSprop": _torch("RMSprop"),
    "Rprop": _torch("Rprop"),
    "Adagrad": _torch("Adagrad"),
    "Adadelta": _torch("Adadelta"),
    "ASGD": _torch("ASGD"),
    "Adafactor": _torch("Adafactor"),
    "SparseAdam": _torch("SparseAdam"),
    "Muon": _torch("Muon"),
    "transformers-Adafactor": _adafactor_hf,
}


def _train(name: str, monitored: bool) -> tuple[Net, Stabilizer | None]:
    net = Net(sparse=name == "SparseAdam")
    params: Any = net.parameters()
    if name == "Muon":  # (Muon takes 2-D weights only: the embedding's table is one too)
        params = [p for p in net.parameters() if p.dim() == 2]
    if name == "SparseAdam":  # (sparse gradients only: the embedding's; the rest not trained)
        params = [net.embed.weight]
    optimizer = OPTIMIZERS[name](params)
    g = torch.Generator().manual_seed(0)
    ids, y = torch.randint(0, 16, (STEPS, 4, 5), generator=g), torch.randn(STEPS, 4, 1, generator=g)
    stab = Stabilizer(net, optimizer, jsonl=False) if monitored else None
    for i in range(STEPS):
        with stab.step() if stab is not None else _nothing():
            loss = net(ids[i], y[i])
            if stab is not None:
                stab.backward(loss)
            else:
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    if stab is not None:
        stab.close()
    return net, stab


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_runs_healthy_under_protect(name: str) -> None:
    if name == "transformers-Adafactor":
        pytest.importorskip("transformers")
    if name == "Muon" and not hasattr(torch.optim, "Muon"):
        pytest.skip("torch has no Muon before 2.9")
    bare, _ = _train(name, monitored=False)
    net, stab = _train(name, monitored=True)
    assert stab is not None and stab.skipped_steps == 0 and stab.host.step == STEPS
    assert not [f for f in stab.findings if f.kind in NAN]
    for a, b in zip(bare.parameters(), net.parameters(), strict=True):
        assert torch.equal(a, b), name  # the step ran as the user wrote it
