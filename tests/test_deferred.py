"""The deferred report: on a GPU the engine and the outputs of step t run during step t + 1.

On the CPU the monitor reports at the step itself; these tests force the deferred path on the
CPU and show that it reports exactly what the synchronous path reports (records, findings), and
that the skip decision is still taken at the step itself: the weights and optimizer state are
untouched by a NaN step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from test_protect import FAULT_STEPS, Fault, assert_intact, tiny

from stabilizer.callbacks.demo.run import run_scenario
from stabilizer.callbacks.monitor import StabilityMonitor
from stabilizer.core.records import Finding
from stabilizer.hosts.loop import Stabilizer
from stabilizer.live.tensors import optimizer_state_tensors


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Tiny models: one torch thread."""


class Untouched(pl.Callback):
    """Whether each fault step left the optimizer's tensors and state bit-for-bit as they were."""

    def __init__(self) -> None:
        self.before: list[torch.Tensor] = []
        self.untouched: dict[int, bool] = {}

    def _tensors(self, trainer: pl.Trainer) -> list[torch.Tensor]:
        opt = trainer.optimizers[0]
        params = [p for g in opt.param_groups for p in g["params"]]
        return [t.detach().clone() for t in [*params, *optimizer_state_tensors(opt)]]

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.before = self._tensors(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        step = trainer.global_step - 1
        if step in FAULT_STEPS:
            after = self._tensors(trainer)
            self.untouched[step] = all(
                torch.equal(a, b) for a, b in zip(self.before, after, strict=True)
            )


class Seen(pl.Callback):
    """Whether the first fault step's finding was out by the end of that step's batch."""

    def __init__(self, monitor: StabilityMonitor) -> None:
        self.monitor, self.on_time = monitor, False

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step - 1 == FAULT_STEPS[0]:
            self.on_time = any(f.step == FAULT_STEPS[0] for f in self.monitor.findings)


class Deferring(StabilityMonitor):
    """The monitor with its reports deferred or not: the switch a CUDA run flips by itself."""

    def __init__(self, deferred: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.deferred = deferred

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        assert self.run is not None
        self.run.reporter.defer = self.deferred


def run(
    tmp: Path, policy: str, deferred: bool, precision: str = "32-true"
) -> tuple[list[str], list[Finding], Untouched]:
    path = tmp / f"{policy}-{deferred}.jsonl"
    monitor = Deferring(deferred, policy=policy, jsonl=path, activation_every=3)
    watch, seen = Untouched(), Seen(monitor)
    run = run_scenario(
        tiny(precision), accelerator="cpu", validate=False,
        callbacks=[Fault("gradient"), watch, monitor, seen],
    )  # fmt: skip
    assert seen.on_time is not deferred  # the deferred path did defer
    if policy != "observe":
        assert_intact(run)
    lines = [ln for ln in path.read_text().splitlines() if json.loads(ln)["type"] == "step"]
    return lines, monitor.findings, watch


def key(f: Finding) -> tuple[object, ...]:
    return (f.kind, f.step, f.end_step, f.severity, f.location)


@pytest.mark.parametrize("policy", ["observe", "protect"])
def test_deferred_reports_what_the_synchronous_path_reports(tmp_path: Path, policy: str) -> None:
    sync_lines, sync_found, _ = run(tmp_path, policy, deferred=False)
    late_lines, late_found, _ = run(tmp_path, policy, deferred=True)
    assert late_lines == sync_lines  # every step record, value for value
    assert [key(f) for f in late_found] == [key(f) for f in sync_found]
    assert any(f.kind == "nonfinite_grad" for f in late_found)


def test_deferred_skip_decision_is_taken_at_the_step(tmp_path: Path) -> None:
    _, found, watch = run(tmp_path, "protect", deferred=True)
    assert watch.untouched == {step: True for step in FAULT_STEPS}  # not a step late
    assert any(f.kind == "root_cause" for f in found)


def test_auto_acts_under_the_deferred_report(tmp_path: Path) -> None:
    # (bf16: in a full-precision run the NaN's remedy, fp32 norms and softmax, has nothing to do)
    _, found, watch = run(tmp_path, "auto", deferred=True, precision="bf16-mixed")
    assert watch.untouched == {step: True for step in FAULT_STEPS}
    applied = [f for f in found if f.kind == "remedy_applied"]
    assert applied  # applied at the next step boundary, for the finding's step


@pytest.mark.parametrize(("policy", "read"), [("observe", False), ("protect", True)])
def test_only_a_deciding_policy_reads_the_numbers_inside_the_step(
    tmp_path: Path, policy: str, read: bool
) -> None:
    """Inside ``optimizer.step`` only a policy that decides (``protect``) waits for the step's
    numbers; ``observe`` lets the step through unread, and its deferred report reads them (on a
    GPU the step never waits for the copy)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, 4)
    with Stabilizer(model, optimizer, policy, log_dir=tmp_path) as stab:
        for i in range(3):
            with stab.step():
                assert stab.run is not None
                stab.run.reporter.defer = True  # as on a GPU
                stab.backward(model(x).pow(2).mean())
                optimizer.step()
                step = stab.run.block.steps[-1]
                assert (step.numbers is not None) is read, i
                optimizer.zero_grad(set_to_none=True)
            assert step.checked is read  # observe's: read at its report, a step later
