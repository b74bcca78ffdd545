"""What the monitor adds to a step, as ``torch.profiler`` sees it inside the monitor's hooks.

The same ops at 2 and at 12 layers (one fused norm over all gradients and the weights' check,
never a loop over the parameters), and no host read (``.item()``, ``float(t)``, ``.tolist()``,
``.numpy()``) other than the one planned read of the step (``HostCopy.read``, named
``stabilizer::host_read``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from test_protect import tiny
from torch.profiler import ProfilerActivity, profile

from stabilizer.callbacks.demo.run import run_scenario
from stabilizer.callbacks.monitor import StabilityMonitor
from stabilizer.live.probes import GradProbe
from stabilizer.live.tensors import CPU_READ, HOST_READ

HOST_READS = {"aten::item", "aten::_local_scalar_dense", "aten::resolve_conj"}
AT = 3  # a steady-state step: after preflight, not an activation-sampled step


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Tiny models: one torch thread."""


class Profiled(StabilityMonitor):
    """The monitor, its hooks at step `AT` run under the profiler; keeps their top-level ops."""

    def __init__(self) -> None:
        super().__init__(jsonl=False)
        self.ops, self._on = Counter[str](), False

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        run = self.run
        assert run is not None
        decide = run.judge
        # The guard's judge (the run) decides inside the optimizer step: it is the monitor's too.
        run.judge = lambda optimizer: self._call_fn(decide, optimizer)  # type: ignore[method-assign]

    def _call_fn(self, fn: Any, *args: Any) -> Any:
        if not self._on:
            return fn(*args)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = fn(*args)
        self.ops.update(e.name for e in prof.events() if e.cpu_parent is None)
        return out

    def _call(self, hook: str, *args: Any) -> None:
        if not self._on:
            getattr(super(), hook)(*args)
            return
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            getattr(super(), hook)(*args)
        self.ops.update(e.name for e in prof.events() if e.cpu_parent is None)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._on = trainer.global_step == AT
        self._call("on_train_batch_start", trainer, *args)

    def on_before_backward(self, *args: Any) -> None:
        self._call("on_before_backward", *args)

    def on_before_optimizer_step(self, *args: Any) -> None:
        self._call("on_before_optimizer_step", *args)

    def on_train_batch_end(self, *args: Any) -> None:
        self._call("on_train_batch_end", *args)


def monitor_ops(n_layer: int) -> Counter[str]:
    sc = tiny("32-true")
    sc = replace(sc, model=replace(sc.model, n_layer=n_layer), steps=AT + 2)
    profiled = Profiled()
    run_scenario(sc, accelerator="cpu", callbacks=[profiled], validate=False)
    return profiled.ops


def host_reads(ops: Counter[str]) -> int:
    return sum(n for name, n in ops.items() if name in HOST_READS)


def test_the_monitor_adds_the_same_ops_at_any_depth() -> None:
    shallow, deep = monitor_ops(2), monitor_ops(12)
    # One fused norm over every gradient and the parameters and optimizer state (the check of
    # the weights; the tiny GPT has no floating buffers), in one pass: never a loop over them.
    assert shallow["aten::_foreach_norm"] == 1
    assert shallow[HOST_READ] == 1  # the one planned read: the step's numbers, once
    # On the CPU only, the gradient norms, taken in float32, are read at once to take a
    # non-finite one again in float64 (a CPU tensor's values: nothing waits); an
    # accelerator's path accumulates in float64 and has no such read.
    assert shallow[CPU_READ] == 1
    assert host_reads(shallow) == 0  # and no other
    assert deep == shallow


def test_an_added_host_read_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    call = GradProbe.__call__

    def leaky(self: GradProbe, check: Any = None) -> torch.Tensor:
        out = call(self, check)
        if out[0].item() < 0:  # what a careless edit adds: the step waits for the device
            raise AssertionError
        return out

    monkeypatch.setattr(GradProbe, "__call__", leaky)
    assert host_reads(monitor_ops(2)) == 1
