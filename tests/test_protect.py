"""Policy ``protect``: faults injected into real training never reach the weights.

Each run trains the reference GPT (tiny) with a real Trainer for a few steps and injects a NaN at
chosen steps into the loss, a forward activation, a gradient in backward, or the optimizer.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from stabilizer.callbacks.demo.lit_gpt import LitGPT
from stabilizer.callbacks.demo.run import ScenarioRun, run_scenario
from stabilizer.callbacks.monitor import StabilityMonitor
from stabilizer.demo.config import GPTConfig
from stabilizer.demo.scenarios import Scenario
from stabilizer.live.tensors import optimizer_state_tensors as state_tensors
from stabilizer.step.guard import Decision, StepGuard
from stabilizer.step.policies import Protect
from stabilizer.step.weights import CPU_SHARES

FAULT_STEPS = (4, 5)
STEPS = 10
PRECISIONS = ["32-true", "bf16-mixed", "16-true", "fp16"]


def tiny(precision: str, **kw: Any) -> Scenario:
    model = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)
    return Scenario(
        "tiny", "protect test", model=model, steps=STEPS, batch_size=4, warmup_steps=2,
        precision=precision, adam_eps=1e-4 if precision == "16-true" else 1e-8, **kw,
    )  # fmt: skip


class NaNGrad(torch.autograd.Function):
    """Identity forward; NaN gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * math.nan


class Fault(pl.Callback):
    """A NaN at the steps `FAULT_STEPS`, in the loss, an activation, a gradient or the optimizer.

    `once`: only the first pass through the faulted module in a step (a transient fault).
    """

    def __init__(self, where: str, once: bool = False) -> None:
        self.where, self.once = where, once
        self.passes = 0

    def _active(self, trainer: pl.Trainer) -> bool:
        return trainer.global_step in FAULT_STEPS

    def on_fit_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        gpt = pl_module.model
        hooks = {
            "loss": (gpt, lambda out: (out[0], out[1] * math.nan)),
            "activation": (gpt.blocks[1].mlp, lambda out: out * math.nan),
            "gradient": (gpt.blocks[0].attn, NaNGrad.apply),
        }
        if self.where in hooks:
            module, fn = hooks[self.where]
            module.register_forward_hook(lambda m, a, out: self._fire(trainer, fn, out))

    def _fire(self, trainer: pl.Trainer, fn: Any, out: Any) -> Any:
        if not self._active(trainer) or (self.once and self.passes):
            return None
        self.passes += 1
        return fn(out)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.passes = 0
        if self.where == "optimizer" and self._active(trainer):
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = math.nan  # the scheduler rewrites it next step


def assert_intact(run: ScenarioRun) -> None:
    for name, p in run.module.named_parameters():
        assert torch.isfinite(p).all(), f"parameter {name} is not finite"
    for opt in run.trainer.optimizers:
        for t in state_tensors(opt):
            assert torch.isfinite(t).all(), "optimizer state is not finite"


def train(sc: Scenario, monitor: StabilityMonitor, fault: Fault | None) -> ScenarioRun:
    callbacks: list[pl.Callback] = [monitor] if fault is None else [fault, monitor]
    return run_scenario(sc, accelerator="cpu", callbacks=callbacks, validate=False)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("where", ["loss", "activation", "gradient"])
def test_nan_never_reaches_the_weights(precision: str, where: str) -> None:
    monitor = StabilityMonitor(jsonl=False)
    run = train(tiny(precision), monitor, Fault(where))
    assert_intact(run)
    assert monitor.guard is not None
    kinds = {f.kind for f in monitor.findings}
    if precision != "fp16" or where == "loss":  # else two skips are a scaler's normal business
        assert kinds & {"nonfinite_loss", "nonfinite_grad"}
    if precision == "fp16":
        # Non-finite gradients under a grad scaler: the scaler skips them, the guard counts them.
        assert monitor.guard.skipped == 0 and monitor.skipped_steps >= len(FAULT_STEPS)
    else:
        assert monitor.guard.skipped == monitor.skipped_steps == len(FAULT_STEPS)
    assert run.trainer.global_step == STEPS  # one-off faults: the run goes on
    causes = [f for f in monitor.findings if f.kind == "root_cause"]
    if precision == "fp16" and where == "gradient":
        assert not causes  # the scaler skipped: no guard skip, no replay
        return
    # The step was replayed under hooks and the injected module named (once per episode).
    assert [(c.step, c.location) for c in causes] == [(FAULT_STEPS[0], (INJECTED[where],))]
    assert causes[0].severity.name == "ERROR" and "numerical" in causes[0].message


INJECTED = {"loss": "model", "activation": "blocks.1.mlp", "gradient": "blocks.0.attn"}


def test_fault_gone_on_replay_is_transient() -> None:
    monitor = StabilityMonitor(jsonl=False)
    run = train(tiny("32-true"), monitor, Fault("activation", once=True))
    assert_intact(run)
    (cause,) = [f for f in monitor.findings if f.kind == "root_cause"]
    assert cause.severity.name == "WARNING" and "transient" in cause.message


@pytest.mark.parametrize("precision", ["32-true", "16-true"])
def test_nan_learning_rate_is_skipped_before_the_optimizer_runs(precision: str) -> None:
    monitor = StabilityMonitor(jsonl=False)
    run = train(tiny(precision), monitor, Fault("optimizer"))
    assert_intact(run)
    assert monitor.guard is not None and monitor.guard.skipped == len(FAULT_STEPS)
    assert monitor.guard.reverted == 0  # decided on the host: nothing to undo
    first = [f for f in monitor.findings if f.kind == "nonfinite_update"]
    assert first and first[0].step == FAULT_STEPS[0] and first[0].location == ("optimizer",)
    assert "learning rate" in first[0].message
    assert not [f for f in monitor.findings if f.kind == "root_cause"]  # no replay: cause known


def test_fp16_adamw_eps_underflow_is_caught_by_default() -> None:
    # AdamW's eps of 1e-8 is 0 in fp16: a weight whose gradient was always 0 gets 0/0 = NaN.
    # The guard is on by default for fp16 parameters.
    monitor = StabilityMonitor(jsonl=False)
    run = train(replace(tiny("16-true"), adam_eps=1e-8), monitor, None)
    assert_intact(run)
    assert monitor.guard is not None and monitor.guard.reverted > 0
    assert any(f.kind == "nonfinite_update" for f in monitor.findings)


class Persistent(Fault):
    def _active(self, trainer: pl.Trainer) -> bool:
        return trainer.global_step >= FAULT_STEPS[0]


def test_stop_after_consecutive_nonfinite_steps() -> None:
    monitor = StabilityMonitor(Protect(stop_after=3), jsonl=False)
    run = train(replace(tiny("32-true"), steps=30), monitor, Persistent("activation"))
    assert_intact(run)
    assert run.trainer.global_step == FAULT_STEPS[0] + 3  # stopped after the third bad step
    assert monitor.guard is not None and monitor.guard.skipped == 3
    assert any(f.severity.name == "ERROR" for f in monitor.findings)


def test_observe_lets_the_nan_through() -> None:
    # The control: without protection the same fault poisons the weights.
    monitor = StabilityMonitor(policy="observe", jsonl=False)
    run = train(tiny("32-true"), monitor, Fault("activation"))
    guard = monitor.guard  # (it measures each step and lets it through as written)
    assert guard is not None and not guard.protects and guard.skipped == guard.reverted == 0
    assert not all(torch.isfinite(p).all() for p in run.module.parameters())


def test_guard_is_removed_after_fit() -> None:
    monitor = StabilityMonitor(jsonl=False)
    run = train(tiny("32-true"), monitor, None)
    for opt in run.trainer.optimizers:
        assert not hasattr(opt.step, "_stabilizer_guard")


class SkipAll:
    """A judge that skips every step (`stabilizer.step.guard.Judge`)."""

    def judge(self, optimizer: torch.optim.Optimizer) -> Decision:
        return Decision(skip=True)

    def ran(self, optimizer: torch.optim.Optimizer, outcome: str) -> None:
        assert outcome == "skipped"

    def first_evaluation(self, optimizer: torch.optim.Optimizer) -> None:
        """(no evaluating optimizer here)"""


def test_skip_leaves_adamw_untouched() -> None:
    # Zeroing gradients is not skipping: weight decay and momentum would still move weights.
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    guard = StepGuard(SkipAll())
    guard.cover([opt])
    before = [p.detach().clone() for p in model.parameters()]
    state = [t.clone() for t in state_tensors(opt)]
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(state, state_tensors(opt), strict=True))
    guard.uninstall()
    assert "step" not in opt.__dict__


def test_a_step_that_cannot_be_checked_is_skipped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Old code: any internal error turned the whole monitor off, and every later NaN got through.
    def broken(self: object) -> torch.Tensor:
        raise RuntimeError("probe exploded")

    monkeypatch.setattr("stabilizer.live.probes.GradProbe.__call__", broken)
    monitor = StabilityMonitor(Protect(stop_after=None), jsonl=False)
    run = train(tiny("32-true"), monitor, Fault("loss"))
    assert run.trainer.global_step == STEPS  # the user's training went on
    warnings = [r for r in caplog.records if "cannot measure the steps" in r.message]
    assert len(warnings) == 1 and "probe exploded" in warnings[0].getMessage()
    assert monitor.guard is not None and monitor.guard.skipped == STEPS  # nothing unchecked
    [critical] = [f for f in monitor.findings if f.kind == "guard_error"]
    assert critical.severity.name == "CRITICAL" and "probe exploded" in critical.message
    assert_intact(run)


def test_an_error_in_reporting_leaves_the_protection_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(self: object, record: object) -> list[object]:
        raise RuntimeError("engine exploded")

    monkeypatch.setattr("stabilizer.core.engine.Engine.observe", broken)
    monitor = StabilityMonitor(jsonl=False)
    run = train(tiny("32-true"), monitor, Fault("gradient"))
    assert run.trainer.global_step == STEPS
    warnings = [r for r in caplog.records if "stopped reporting" in r.message]
    assert len(warnings) == 1 and "engine exploded" in warnings[0].getMessage()
    assert monitor.guard is not None and monitor.guard.skipped == len(FAULT_STEPS)
    assert_intact(run)


def test_strict_monitor_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: object) -> torch.Tensor:
        raise RuntimeError("probe exploded")

    monkeypatch.setattr("stabilizer.live.probes.GradProbe.__call__", broken)
    with pytest.raises(RuntimeError, match="probe exploded"):
        train(tiny("32-true"), StabilityMonitor(jsonl=False, strict=True), None)


class LeakyLitGPT(LitGPT):
    """The reference GPT with its causal mask broken: every position sees the whole sequence."""

    def __init__(self, config: GPTConfig, **kwargs: Any) -> None:
        super().__init__(replace(config, attention="manual"), **kwargs)
        for block in self.model.blocks:
            block.attn.mask.fill_(True)


def test_preflight_catches_a_causal_leak() -> None:
    monitor = StabilityMonitor(jsonl=False)
    run_scenario(tiny("32-true"), accelerator="cpu", callbacks=[monitor], validate=False,
                 module_class=LeakyLitGPT)  # fmt: skip
    (leak,) = [f for f in monitor.findings if f.kind == "causal_leak"]
    assert leak.step == 0 and leak.severity.name == "CRITICAL"
    assert leak.evidence["first_position"] == 0


def test_reference_gpt_passes_preflight() -> None:
    monitor = StabilityMonitor(jsonl=False)
    train(tiny("32-true"), monitor, None)
    kinds = [(f.kind, f.severity.name) for f in monitor.findings]
    assert ("causal_leak", "CRITICAL") not in kinds
    assert kinds == [("config_risk", "INFO")]  # only: no gradient clipping configured


class KwargsOnlyLitGPT(LitGPT):
    """A module whose forward does not take token ids: the causal self-check cannot call it."""

    def forward(self, *, batch: dict[str, torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        return super().forward(batch["ids"])


def test_checks_that_cannot_run_leave_the_protection_on(caplog: pytest.LogCaptureFixture) -> None:
    monitor = StabilityMonitor(jsonl=False)
    run = run_scenario(tiny("32-true"), accelerator="cpu", callbacks=[Fault("activation"),
                       monitor], validate=False, module_class=KwargsOnlyLitGPT)  # fmt: skip
    assert_intact(run)
    assert "preflight causal self-check skipped" in caplog.text
    assert "preflight config checks skipped" not in caplog.text  # (one check lost, not both)
    assert ("config_risk", "INFO") in [(f.kind, f.severity.name) for f in monitor.findings]
    assert monitor.guard is not None and monitor.guard.skipped == len(FAULT_STEPS)


def test_persistent_optimizer_nan_is_named_and_stops_the_run() -> None:
    # Pure fp16 with AdamW's eps of 1e-8: every step's update is non-finite from the start.
    monitor = StabilityMonitor(jsonl=False)
    run = train(replace(tiny("16-true"), adam_eps=1e-8, steps=30), monitor, None)
    assert_intact(run)
    critical = [f for f in monitor.findings if f.severity.name == "CRITICAL"]
    assert critical and critical[0].kind == "nonfinite_update"
    assert run.trainer.global_step == 10  # stopped after stop_after bad steps: nothing to gain


class StateNaN(pl.Callback):
    """A NaN written into one Adam moment between two steps (as a buggy optimizer would), of a
    parameter frozen at the same time: no later loss or gradient shows it, only the check of
    the optimizer state can find it."""

    def __init__(self, after: int) -> None:
        self.after = after

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.after:
            opt = trainer.optimizers[0]
            *_, (param, state) = opt.state.items()
            param.requires_grad_(False)
            state["exp_avg_sq"].view(-1)[0] = math.nan


@pytest.mark.parametrize("after", range(3, 3 + CPU_SHARES))
def test_a_nan_in_the_optimizer_state_is_found_before_the_next_step(after: int) -> None:
    # On the CPU each step checks a share of the parameters in turn, but all of the optimizer
    # state: whichever share the moment's parameter is in, the NaN is found before the next
    # step, said critical, and the run stops.
    monitor = StabilityMonitor(jsonl=False)
    run = run_scenario(
        replace(tiny("32-true"), steps=20), accelerator="cpu",
        callbacks=[StateNaN(after), monitor], validate=False,
    )  # fmt: skip
    critical = [f for f in monitor.findings if f.kind == "nonfinite_update"]
    assert critical and critical[0].severity.name == "CRITICAL"
    assert critical[0].step == after  # step `after` is the next one
    assert "NOT intact" in critical[0].message and run.trainer.should_stop
