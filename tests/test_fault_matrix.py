"""The fault matrix: setups x faults, run through the step itself in a plain PyTorch loop.

Each case trains a tiny model ten steps in a plain loop with `Stabilizer` (the step's plain-loop
host, `stabilizer.hosts.loop`) under ``protect``, no ``Trainer``, and asserts what the
protection promises (docs/protection.md): parameters, optimizer state and buffers end finite;
the step that held the fault left them bit-identical; a healthy run is not stopped; every claim
the console made about the weights is true. The faults that are about Lightning's own hook
points run on a real ``Trainer`` in ``tests/test_fault_matrix_lightning.py``.

Faults are put where a loop's code puts them, at step `FAULT`: ``loss`` (a NaN made in the
model's forward, which returns the loss as nanoGPT's and Hugging Face's models do), ``batch`` (a
NaN in the input; under accumulation in the last micro-batch), ``grad`` (a NaN written into a
gradient before ``optimizer.step``, which measures it; into the imaginary part of a complex
one), ``grad_after`` / ``grad_data_after`` (written after ``stab.before_step`` measured the
step: in place, or through ``.data``, which torch's version counters do not see),
``clip_zero`` (the loop's own clipping after ``before_step`` divides all-zero gradients by
their norm: 0/0), ``lr`` (a NaN learning rate for one step), ``grad_b`` (the second optimizer's
loss is NaN), ``buffer`` (a NaN written into BatchNorm's running mean between steps), ``none``.

Which setup x fault pairs run where (``P``: here, ``L``: on a real ``Trainer``):

================ ==========================================================================
setup            faults
================ ==========================================================================
plain            P: none, loss, batch, grad, grad_after, grad_data_after, clip_zero,
                 lr.  L (``auto``): none, loss, batch, NaN gradient in a callback before /
                 after the monitor, in the module's ``on_before_optimizer_step`` (in place,
                 ``.data``) and ``configure_gradient_clipping``, an optimizer replaced mid-run
accum (2)        P: none, loss, batch (the failing micro-batch named), grad.  L: loss (named)
manual           L: none, loss (the replay steps no optimizer, counts no step)
two-optimizers   P: none, loss, lr, grad_b (only its own step skipped).  L: grad_b (manual)
shared-loss      P: none, loss, grad
lbfgs            P: none, loss, batch (``before_step`` in the closure, Lightning's order)
lbfgs-in-step    P: none, loss (measured inside ``step``), its record as it started; both: one
                 micro-batch however many evaluations
swa              L: none, loss
fp64             P: none, loss, grad
complex          P: none, loss, grad
bf16 (autocast)  P: none, loss.  L: NaN gradient in a callback after the monitor
fp16 + scaler    P: none, loss, grad_after (a real ``torch.amp.GradScaler``; Lightning's
                 ``16-mixed`` on the CPU is bf16)
batchnorm        P: none, batch, buffer (critical: not intact, stop)
attention-4d     P: none (the activation probe drops only its own signal)
returns-none     P: none, loss (steps without a backward).  L: none (``training_step``
                 returns ``None``)
eps0             P: none (the copy-and-check undoes each non-finite update, said)
================ ==========================================================================
"""

from __future__ import annotations

import json
import logging
import math
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from stabilizer.hosts.loop import Stabilizer
from stabilizer.live.tensors import all_finite, optimizer_state_tensors

FAULT = 4  # the step of the fault
STEPS = 10
LR = 1e-2


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Tiny models: one torch thread (see conftest)."""


class Attention(nn.Module):
    """Named like nanoGPT's attention (``c_attn``, ``n_head``), but called on 4-D input: the
    activation probe's scores hook cannot read it."""

    def __init__(self) -> None:
        super().__init__()
        self.c_attn, self.n_head = nn.Linear(8, 24), 2

    def forward(self, x: Tensor) -> Tensor:
        qkv = self.c_attn(x.view(x.size(0), 1, 1, 8))  # (B, 1, 1, 24): not nanoGPT's (B, T, 3C)
        return qkv[..., :8].reshape(x.size(0), 8)


@dataclass(frozen=True)
class Setup:
    optimizers: int = 1  # 2: two losses (GAN-like), or one shared loss (`shared`)
    shared: bool = False
    optimizer: str = "adamw"  # adamw | lbfgs | adam_eps0
    precision: str = "32-true"  # 32-true | 64-true | bf16-mixed | 16-mixed (a grad scaler)
    accumulate: int = 1
    before_step: bool = False  # the loop calls `stab.before_step` (else: measured in `step`)
    bn: bool = False
    attention: bool = False
    complex: bool = False
    returns_none: bool = False


class Net(nn.Module):
    """Returns its loss, as nanoGPT's and Hugging Face's models do: a NaN made in it is made
    again when the root cause replays the model's call."""

    def __init__(self, setup: Setup) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.norm = nn.BatchNorm1d(8) if setup.bn else nn.Identity()
        self.attn = Attention() if setup.attention else nn.Identity()
        self.b = nn.Linear(8, 1)
        self.frozen_zero = nn.Parameter(torch.ones(3))  # its gradient is always exactly 0
        self.c = nn.Parameter(torch.zeros(2, dtype=torch.complex64)) if setup.complex else None
        self.nan_loss = False  # the fault `loss`, on during its step
        self.zero_loss = False  # all-zero gradients (the fault `clip_zero`)

    def forward(self, x: Tensor, y: Tensor, part: int = 0) -> Tensor:
        if part == 1:  # the second optimizer's own loss
            return (self.b(self.a(x)) ** 2).mean()
        out = self.b(self.attn(torch.relu(self.norm(self.a(x))))) + 0.0 * self.frozen_zero.sum()
        if self.c is not None:
            out = out + 1e-3 * (self.c.real**2).sum()
        loss = ((out.float() - y.float()) ** 2).mean()
        if self.nan_loss:
            loss = loss * math.nan
        if self.zero_loss:
            loss = loss * 0.0
        return loss


def optimizers(setup: Setup, net: Net) -> list[torch.optim.Optimizer]:
    if setup.optimizer == "lbfgs":
        return [torch.optim.LBFGS(net.parameters(), lr=0.1, max_iter=3)]
    if setup.optimizers == 2:
        return [
            torch.optim.AdamW([*net.a.parameters(), net.frozen_zero], lr=LR),
            torch.optim.AdamW(net.b.parameters(), lr=LR),
        ]
    eps = 0.0 if setup.optimizer == "adam_eps0" else 1e-8
    return [torch.optim.AdamW(net.parameters(), lr=LR, eps=eps)]


def held(net: nn.Module, opts: list[torch.optim.Optimizer]) -> list[Tensor]:
    """What the promise covers: parameters, optimizer state, buffers."""
    state = [t for opt in opts for t in optimizer_state_tensors(opt)]
    return [*net.parameters(), *state, *net.buffers()]


@dataclass
class Loop:
    """A plain training loop as users write it, with the fault put in."""

    setup: Setup
    fault: str
    net: Net
    opts: list[torch.optim.Optimizer]
    stab: Stabilizer
    scaler: Any

    def step(self, i: int, micro: list[tuple[Tensor, Tensor]]) -> None:
        """Step `i`: its micro-batches, backward and optimizer steps."""
        now = i == FAULT
        self.net.nan_loss = now and self.fault == "loss"
        self.net.zero_loss = now and self.fault == "clip_zero"
        if now and self.fault == "batch":
            micro[-1][0][0, 0] = math.nan  # the batch as the data loader handed it over
        if self.setup.optimizer == "lbfgs":
            self._lbfgs(micro[0])
        elif self.setup.optimizers == 2 and not self.setup.shared:
            self._two_losses(micro[0], now)
        else:
            self._one_loss(micro, backward=not (self.setup.returns_none and i % 3 == 2))
            if now and self.fault == "grad":
                self._nan_grad()
            for opt in self.opts:
                self._optimizer_step(opt, now)
                opt.zero_grad()
            if self.scaler is not None:
                self.scaler.update()

    def _one_loss(self, micro: list[tuple[Tensor, Tensor]], backward: bool) -> None:
        dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(self.setup.precision)
        for x, y in micro:
            with torch.autocast("cpu", dtype=dtype) if dtype is not None else nullcontext():
                loss = self.net(x, y)
            if backward:  # else a step with nothing to learn from its batch: no backward
                self.stab.backward(loss / len(micro))

    def _optimizer_step(self, opt: torch.optim.Optimizer, now: bool) -> None:
        """The optimizer's step, with the loop's own code before it (after `before_step`)."""
        if self.scaler is not None:
            self.scaler.unscale_(opt)
        if self.scaler is not None or self.setup.before_step or self.fault in _AFTER:
            self.stab.before_step(opt)  # measured here: the scaler may not call the optimizer
        if now and self.fault in ("grad_after", "grad_data_after"):
            self._nan_grad(data=self.fault == "grad_data_after")
        if self.fault == "clip_zero":  # normalise by the norm: 0/0 on all-zero gradients
            grads = [p.grad for p in self.net.parameters() if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
            for g in grads:
                g.div_(norm)
        if self.scaler is not None:
            self.scaler.step(opt)
        else:
            opt.step()

    def _nan_grad(self, data: bool = False) -> None:
        if self.net.c is not None:  # a complex gradient: NaN in its imaginary part only
            assert self.net.c.grad is not None
            self.net.c.grad[0] = complex(0.0, math.nan)
            return
        grad = self.net.a.weight.grad
        assert grad is not None
        (grad.data if data else grad)[0, 0] = math.nan

    def _two_losses(self, batch: tuple[Tensor, Tensor], now: bool) -> None:
        """Each optimizer its own loss and backward (a GAN's pattern)."""
        for part, opt in enumerate(self.opts):
            opt.zero_grad()
            loss = self.net(*batch, part=part)
            if part == 1 and now and self.fault == "grad_b":
                loss = loss * math.nan
            self.stab.backward(loss)
            opt.step()

    def _lbfgs(self, batch: tuple[Tensor, Tensor]) -> None:
        (opt,) = self.opts

        def closure() -> Tensor:
            opt.zero_grad()
            loss = self.net(*batch)
            self.stab.backward(loss)
            if self.setup.before_step:
                self.stab.before_step(opt)
            return loss

        opt.step(closure)


_AFTER = ("grad_after", "grad_data_after", "clip_zero")  # faults written after `before_step`


@dataclass
class Run:
    stab: Stabilizer
    net: Net
    opts: list[torch.optim.Optimizer]
    steps: int = 0  # loop iterations run
    identical: bool | None = None  # the fault's step left everything bit-identical
    lines: tuple[str, ...] = ()  # the console's lines


def train(
    setup: Setup, fault: str, caplog: pytest.LogCaptureFixture, jsonl: Path | bool = False
) -> Run:
    """Ten steps of the loop under ``protect``, the fault at step `FAULT`; stops when told."""
    torch.manual_seed(0)
    net = Net(setup).double() if setup.precision == "64-true" else Net(setup)
    opts = optimizers(setup, net)
    scaler = torch.amp.GradScaler("cpu") if setup.precision == "16-mixed" else None
    g = torch.Generator().manual_seed(0)
    n, dtype = STEPS * setup.accumulate, net.a.weight.dtype
    x, y = torch.randn(n, 4, 4, generator=g, dtype=dtype), torch.randn(n, 4, 1, generator=g)
    data = list(zip(x, y, strict=True))
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="stabilizer"):
        warnings.simplefilter("ignore")
        stab = Stabilizer(
            net, opts, scaler=scaler, precision=setup.precision, jsonl=jsonl,
            activation_every=1 if setup.attention else 50,
        )  # fmt: skip
        loop, run = Loop(setup, fault, net, opts, stab, scaler), Run(stab, net, opts)
        for i in range(STEPS):
            _between_steps(fault, i, net, opts)
            before = [t.detach().clone() for t in held(net, opts)] if i == FAULT else None
            with stab.step():
                loop.step(i, data[i * setup.accumulate : (i + 1) * setup.accumulate])
            if before is not None:
                after = held(net, opts)
                run.identical = len(after) == len(before) and all(
                    torch.equal(a, b) for a, b in zip(before, after, strict=True)
                )
            run.steps += 1
            if stab.should_stop:
                break
        stab.close()
    run.lines = tuple(r.getMessage() for r in caplog.records if r.name == "stabilizer")
    return run


def _between_steps(fault: str, i: int, net: Net, opts: list[torch.optim.Optimizer]) -> None:
    """Faults the loop writes between steps: a NaN learning rate for one step, a NaN buffer."""
    if fault == "lr" and i in (FAULT, FAULT + 1):
        for group in opts[0].param_groups:
            group["lr"] = math.nan if i == FAULT else LR
    if fault == "buffer" and i == FAULT:
        running_mean = net.norm.running_mean
        assert isinstance(running_mean, Tensor)
        running_mean[0] = math.nan


def assert_claims_true(run: Run) -> None:
    """Every sentence about the weights is what they are."""
    claims = [line for line in run.lines if "weights intact" in line or "checked finite" in line]
    denials = [line for line in run.lines if "NOT intact" in line]
    if all_finite(held(run.net, run.opts)):
        assert not denials
    else:
        assert denials and not any("done at step" in line for line in claims)


SETUPS = {
    "plain": Setup(),
    "accum": Setup(accumulate=2),
    "two-optimizers": Setup(optimizers=2),
    "shared-loss": Setup(optimizers=2, shared=True),
    "lbfgs": Setup(optimizer="lbfgs", before_step=True),
    "lbfgs-in-step": Setup(optimizer="lbfgs"),
    "fp64": Setup(precision="64-true"),
    "complex": Setup(complex=True),
    "bf16": Setup(precision="bf16-mixed"),
    "fp16": Setup(precision="16-mixed"),
    "batchnorm": Setup(bn=True),
    "attention-4d": Setup(attention=True),
    "returns-none": Setup(returns_none=True),
    "eps0": Setup(optimizer="adam_eps0"),
}


# (setup, fault, the fault's step is skipped and leaves everything bit-identical)
CASES = [
    ("plain", "none", False),
    ("plain", "loss", True),
    ("plain", "batch", True),
    ("plain", "grad", True),
    ("plain", "grad_after", True),
    ("plain", "grad_data_after", True),
    ("plain", "clip_zero", True),
    ("plain", "lr", True),
    ("accum", "none", False),
    ("accum", "loss", True),
    ("accum", "batch", True),
    ("accum", "grad", True),
    ("two-optimizers", "none", False),
    ("two-optimizers", "loss", False),  # the first optimizer's step skipped, the second's not
    ("two-optimizers", "lr", False),  # (the first optimizer's LR)
    ("two-optimizers", "grad_b", False),  # the first optimizer steps, the second skips
    ("shared-loss", "none", False),
    ("shared-loss", "loss", True),
    ("shared-loss", "grad", False),  # a NaN in `a`'s gradient: the second optimizer steps
    ("lbfgs", "none", False),
    ("lbfgs", "loss", True),
    ("lbfgs", "batch", True),
    ("lbfgs-in-step", "none", False),
    ("lbfgs-in-step", "loss", True),
    ("fp64", "none", False),
    ("fp64", "loss", True),
    ("fp64", "grad", True),
    ("complex", "none", False),
    ("complex", "loss", True),
    ("complex", "grad", True),
    ("bf16", "none", False),
    ("bf16", "loss", True),
    ("fp16", "none", False),
    ("fp16", "loss", True),
    ("fp16", "grad_after", True),
    ("batchnorm", "none", False),
    ("batchnorm", "batch", True),
    ("attention-4d", "none", False),
    ("returns-none", "none", False),
    ("returns-none", "loss", True),
]


def _id(case: Any) -> str:
    values = case.values if hasattr(case, "values") else case
    return f"{values[0]}-{values[1]}"


@pytest.mark.parametrize(("setup", "fault", "identical"), CASES, ids=[_id(c) for c in CASES])
def test_fault_matrix(
    setup: str, fault: str, identical: bool, caplog: pytest.LogCaptureFixture
) -> None:
    run = train(SETUPS[setup], fault, caplog)
    assert all_finite(held(run.net, run.opts)), "a non-finite value reached the weights"
    assert run.steps == STEPS and not run.stab.should_stop
    assert not any("stopping at" in line for line in run.lines)
    assert_claims_true(run)
    guard = run.stab.guard
    assert guard is not None
    if fault == "none":
        kinds = {f.kind for f in run.stab.findings}
        assert not kinds & {"nonfinite_loss", "nonfinite_grad", "nonfinite_update", "guard_error"}
        assert guard.skipped == guard.reverted == 0
        if setup != "fp16":  # (a grad scaler skips its first steps, as it does without us)
            assert run.stab.skipped_steps == 0
    if identical:
        assert run.identical, "the skipped step changed the weights, state or buffers"
        assert run.stab.skipped_steps >= 1
    elif fault in ("loss", "lr", "grad_b", "grad"):  # one optimizer skipped, the other not
        assert guard.skipped == 1 and not run.identical
    if setup.startswith("lbfgs"):  # one step per optimizer step, however many evaluations
        assert run.stab.skipped_steps == int(fault != "none")


def _cause(run: Run) -> str:
    (cause,) = [f for f in run.stab.findings if f.kind == "root_cause"]
    return cause.message


def test_two_optimizers_skip_only_the_one_with_nan(caplog: pytest.LogCaptureFixture) -> None:
    run = train(SETUPS["two-optimizers"], "grad_b", caplog)
    guard = run.stab.guard
    assert guard is not None and guard.skipped == 1  # the second optimizer's step at the fault
    assert run.stab.host.step == STEPS  # a plain loop's step is its block (both optimizers)


def test_a_nan_made_in_the_model_is_reproduced_by_the_replay(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cause = _cause(train(SETUPS["plain"], "loss", caplog))
    assert "reproduced" in cause and "transient" not in cause


def test_a_nan_batch_is_named_as_the_input(caplog: pytest.LogCaptureFixture) -> None:
    assert "input batch holds NaN/Inf" in _cause(train(SETUPS["plain"], "batch", caplog))


def test_accumulation_names_the_micro_batch_that_failed(caplog: pytest.LogCaptureFixture) -> None:
    cause = _cause(train(SETUPS["accum"], "batch", caplog))
    assert cause.startswith("micro-batch 2 of 2:") and "input batch holds NaN/Inf" in cause


def test_eps0_updates_are_undone_and_said(caplog: pytest.LogCaptureFixture) -> None:
    """Every step of ``eps=0`` AdamW makes ``frozen_zero`` 0/0 = NaN: each is undone (so the
    run stops after ``stop_after`` of them), said, and the weights stay finite."""
    run = train(SETUPS["eps0"], "none", caplog)
    assert all_finite(held(run.net, run.opts))
    assert_claims_true(run)
    guard = run.stab.guard
    assert guard is not None and guard.reverted >= 1
    risks = [f for f in run.stab.findings if f.kind == "config_risk" and "eps=0" in f.message]
    assert risks and risks[0].severity.name == "WARNING"


def test_a_nan_buffer_is_reported_and_never_called_intact(
    caplog: pytest.LogCaptureFixture,
) -> None:
    run = train(SETUPS["batchnorm"], "buffer", caplog)
    critical = [f for f in run.stab.findings if f.severity.name == "CRITICAL"]
    assert critical and "NOT intact" in critical[0].message
    assert "buffer norm.running_mean" in critical[0].message
    assert run.stab.should_stop and run.steps == FAULT + 1
    assert_claims_true(run)
    assert any("NOT intact" in line for line in run.lines)
    assert not any("weights intact" in line for line in run.lines)


def test_a_probe_that_cannot_read_a_module_drops_only_that_signal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    train(SETUPS["attention-4d"], "none", caplog)
    dropped = [r for r in caplog.records if "activation probe" in r.getMessage()]
    assert len(dropped) == 1 and "attn.scores" in dropped[0].getMessage()


def test_lbfgs_measured_in_the_step_records_its_first_evaluation(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """As with ``before_step`` in the closure (Lightning's order): the loss the step started
    from, once, not the sum of LBFGS's evaluations."""
    records = []
    for setup in ("lbfgs", "lbfgs-in-step"):
        path = tmp_path / f"{setup}.jsonl"
        train(SETUPS[setup], "none", caplog, jsonl=path)
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        records.append([r["values"] for r in lines if r.get("type") == "step"])
    early, inside = records
    assert [r["loss"] for r in inside] == [r["loss"] for r in early]
    assert [r["grad_norm"] for r in inside] == [r["grad_norm"] for r in early]


@pytest.mark.parametrize("setup", ["lbfgs", "lbfgs-in-step"])
def test_lbfgs_evaluations_are_not_micro_batches(
    setup: str, caplog: pytest.LogCaptureFixture
) -> None:
    """One batch, evaluated three times by LBFGS, is one micro-batch (as on Lightning)."""
    assert not _cause(train(SETUPS[setup], "loss", caplog)).startswith("micro-batch")
