"""Nothing of a step outlives it: no gradient, input or activation of a step is kept alive by
the monitor after the step ends (with ``zero_grad(set_to_none=True)`` a kept gradient would be a
second copy of the model's gradients during the next forward and backward).

Weak references to a step's tensors are taken while they are alive; once the training code has
let them go (``zero_grad(set_to_none=True)``, its own variables dropped), they must be dead,
without ``gc.collect()``: a reference cycle holding them would keep them just as long.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from test_protect import tiny

from stabilizer import Stabilizer
from stabilizer.callbacks.demo.run import run_scenario
from stabilizer.callbacks.monitor import StabilityMonitor
from stabilizer.demo.data import RandomWindows, load_corpus
from stabilizer.demo.model import GPT, GPTConfig
from stabilizer.step.policies import Auto, Observe, Protect

POLICIES = [Observe(), Protect(), Auto()]


def _alive(refs: dict[str, weakref.ref[torch.Tensor]]) -> list[str]:
    return [name for name, ref in refs.items() if ref() is not None]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_a_loop_step_leaves_no_gradient_input_or_activation_behind(
    policy: Any, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = RandomWindows(load_corpus().train, 16, 4, 6, seed=0)
    stab = Stabilizer(model, optimizer, policy, log_dir=tmp_path)
    for step in range(6):
        x, y = data[step]
        with stab.step():
            logits, loss = model(x, y)
            stab.backward(loss)
            refs = {f"grad of {n}": weakref.ref(p.grad) for n, p in model.named_parameters()}
            refs |= {"input": weakref.ref(x), "logits": weakref.ref(logits)}
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        del x, y, logits, loss  # the loop's own references
        assert _alive(refs) == [], f"step {step}"
    stab.close()


class Watch(pl.Callback):
    """After the monitor: notes weak references to each step's batch and gradients, and which
    of them are still alive at the next step's backward (Lightning zeroed the gradients with
    ``set_to_none`` just before)."""

    def __init__(self) -> None:
        self.batch: dict[str, weakref.ref[torch.Tensor]] = {}
        self.refs: dict[str, weakref.ref[torch.Tensor]] = {}
        self.alive: list[list[str]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, i: int) -> None:
        self.batch = {f"batch[{j}]": weakref.ref(t) for j, t in enumerate(batch)}

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: Any, opt: Any) -> None:
        grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
        self.refs = self.batch | {f"grad of {n}": weakref.ref(g) for n, g in grads.items()}

    def on_before_backward(self, trainer: pl.Trainer, module: Any, loss: torch.Tensor) -> None:
        if self.refs:  # the last step's
            self.alive.append(_alive(self.refs))
        self.refs = {}


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_a_lightning_step_leaves_no_gradient_or_batch_behind(policy: Any) -> None:
    watch = Watch()
    monitor = StabilityMonitor(policy, jsonl=False)
    run_scenario(tiny("32-true"), accelerator="cpu", callbacks=[monitor, watch], validate=False)
    assert len(watch.alive) == 9  # at each step's backward from the second on
    assert all(alive == [] for alive in watch.alive), watch.alive


def test_without_the_monitor_nothing_is_left_behind_either() -> None:
    # The yardstick of the test above: Lightning itself lets go of them by then.
    watch = Watch()
    run_scenario(tiny("32-true"), accelerator="cpu", callbacks=[watch], validate=False)
    assert len(watch.alive) == 9 and all(alive == [] for alive in watch.alive)
