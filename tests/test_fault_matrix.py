"""The fault matrix: setups x faults, each a real Lightning fit of a tiny model with ``protect``.

Every case asserts what the protection promises: parameters, optimizer state and buffers end
finite; a step that held the fault left them bit-identical; a healthy run is not stopped; every
claim the console made about the weights is true. Faults are injected where users' code puts
them: the loss, a batch, a gradient written at each hook point (before and after the monitor,
the module's own hook, its clipping), the learning rate, ``eps=0``, a buffer, a probe that raises.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import StochasticWeightAveraging
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from stabilizer.callbacks.monitor import StabilityMonitor
from stabilizer.live.tensors import all_finite, optimizer_state_tensors

FAULT = 4  # the batch index of the fault
BATCHES = 10


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


@dataclass
class Setup:
    manual: bool = False
    optimizers: int = 1  # manual: 2 = two losses (GAN-like); "shared" = one loss, two optimizers
    shared: bool = False
    optimizer: str = "adamw"  # adamw | lbfgs | adam_eps0
    precision: str = "32-true"
    accumulate: int = 1
    bn: bool = False
    attention: bool = False
    complex: bool = False
    returns_none: bool = False
    trainer: dict[str, Any] = field(default_factory=dict)


class Net(pl.LightningModule):
    def __init__(self, setup: Setup, fault: str) -> None:
        super().__init__()
        self.setup_, self.fault = setup, fault
        self.automatic_optimization = not setup.manual
        self.a = nn.Linear(4, 8)
        self.norm = nn.BatchNorm1d(8) if setup.bn else nn.Identity()
        self.attn = Attention() if setup.attention else nn.Identity()
        self.b = nn.Linear(8, 1)
        self.frozen_zero = nn.Parameter(torch.ones(3))  # its gradient is always exactly 0
        self.c = nn.Parameter(torch.zeros(2, dtype=torch.complex64)) if setup.complex else None

    def forward(self, x: Tensor) -> Tensor:
        h = self.attn(torch.relu(self.norm(self.a(x))))
        out = self.b(h) + 0.0 * self.frozen_zero.sum()
        if self.c is not None:
            out = out + 1e-3 * (self.c.real**2).sum()
        return out

    def _loss(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = ((self(x) - y) ** 2).mean()
        if self.fault in ("loss", "replaced") and batch_idx == FAULT:
            loss = loss * math.nan
        if self.fault == "clip_hook" and batch_idx == FAULT:
            loss = loss * 0.0  # all-zero gradients
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> Tensor | None:
        if self.setup_.returns_none and batch_idx % 3 == 1:
            return None  # Lightning's documented way to skip a batch
        if not self.setup_.manual:
            return self._loss(batch, batch_idx)
        opts = self.optimizers()
        opts = opts if isinstance(opts, list) else [opts]
        if self.setup_.shared:  # one backward, two optimizers (the Muon + AdamW pattern)
            loss = self._loss(batch, batch_idx)
            self.manual_backward(loss)
            for opt in opts:
                opt.step()
                opt.zero_grad()
            return loss
        x = batch[0]
        for i, opt in enumerate(opts):
            part = self._loss(batch, batch_idx) if i == 0 else (self.b(self.a(x)) ** 2).mean()
            if i == 1 and self.fault == "grad_b" and batch_idx == FAULT:
                part = part * math.nan
            opt.zero_grad()
            self.manual_backward(part)
            opt.step()
        return None

    def configure_optimizers(self) -> Any:
        kind = self.setup_.optimizer
        if kind == "lbfgs":
            return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)
        eps = 0.0 if kind == "adam_eps0" else 1e-8
        if self.setup_.optimizers == 2:
            return [
                torch.optim.AdamW([*self.a.parameters(), self.frozen_zero], lr=1e-2),
                torch.optim.AdamW(self.b.parameters(), lr=1e-2),
            ]
        return torch.optim.AdamW(self.parameters(), lr=1e-2, eps=eps)

    def train_dataloader(self) -> DataLoader[tuple[Tensor, ...]]:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(4 * BATCHES, 4, generator=g), torch.randn(4 * BATCHES, 1, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=4)


class HookNet(Net):
    """The module's own hooks after the monitor's: ``on_before_optimizer_step`` writes a NaN
    (in place, or through ``.data``, which torch's version counters do not see), and
    ``configure_gradient_clipping`` normalises by the norm (0/0 on all-zero gradients)."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.fault in ("lm_hook", "lm_hook_data") and self.trainer.fit_loop.batch_idx == FAULT:
            grad = self.a.weight.grad
            assert grad is not None
            (grad.data if self.fault == "lm_hook_data" else grad)[0, 0] = math.nan

    def configure_gradient_clipping(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        if self.fault == "clip_hook":  # normalise by the norm: 0/0 on an all-zero gradient
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
            for g in grads:
                g.div_(norm)


class Inject(pl.Callback):
    """Faults a callback puts in: a gradient before/after the monitor, a NaN LR, a NaN batch or
    sample, a NaN buffer, an optimizer replaced mid-run."""

    def __init__(self, fault: str) -> None:
        self.fault = fault

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, i: int) -> None:
        if i == FAULT and self.fault == "lr":
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = math.nan
        elif i == FAULT + 1 and self.fault == "lr":
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = 1e-2
        if i == FAULT and self.fault == "batch":
            batch[0][0, 0] = math.nan  # the batch as the data loader handed it over
        if i == FAULT and self.fault == "buffer":
            module.norm.running_mean[0] = math.nan
        if i == 2 and self.fault == "replaced":  # a new optimizer, never seen at fit start
            trainer.optimizers = [torch.optim.AdamW(module.parameters(), lr=1e-2)]

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: Any, optimizer: Any) -> None:
        if self.fault in ("cb_after", "cb_before") and trainer.fit_loop.batch_idx == FAULT:
            grad = module.a.weight.grad
            assert grad is not None
            grad[0, 0] = math.nan


class Witness(pl.Callback):
    """Copies parameters, optimizer state and buffers before the fault's step; compares after."""

    def __init__(self) -> None:
        self.before: list[Tensor] | None = None
        self.identical: bool | None = None
        self._step = -1

    def _tensors(self, trainer: pl.Trainer, module: nn.Module) -> list[Tensor]:
        state = [t for opt in trainer.optimizers for t in optimizer_state_tensors(opt)]
        return [*module.parameters(), *state, *module.buffers()]

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, i: int) -> None:
        if i == FAULT and self.before is None:
            self.before = [t.detach().clone() for t in self._tensors(trainer, module)]
            self._step = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
        if self.before is not None and self.identical is None and trainer.global_step > self._step:
            after = self._tensors(trainer, module)
            self.identical = len(after) == len(self.before) and all(
                torch.equal(a, b) for a, b in zip(self.before, after, strict=True)
            )


@dataclass
class Run:
    monitor: StabilityMonitor
    trainer: pl.Trainer
    module: Net
    witness: Witness
    lines: list[str]


def fit(setup: Setup, fault: str, caplog: pytest.LogCaptureFixture) -> Run:
    hooked = fault in ("lm_hook", "lm_hook_data", "clip_hook")
    module, witness = (HookNet if hooked else Net)(setup, fault), Witness()
    monitor = StabilityMonitor(jsonl=False, activation_every=1 if setup.attention else 50)
    inject = Inject(fault)
    before, after = ([inject], []) if fault != "cb_after" else ([], [inject])
    callbacks: list[pl.Callback] = [witness, *before, monitor, *after]
    if setup.trainer.get("swa"):
        callbacks.append(StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=2 if setup.trainer.get("swa") else 1,
        callbacks=callbacks,
        precision=setup.precision, accumulate_grad_batches=setup.accumulate, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )  # fmt: skip
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="stabilizer"):
        warnings.simplefilter("ignore")
        trainer.fit(module)
    lines = [r.getMessage() for r in caplog.records if r.name == "stabilizer"]
    return Run(monitor, trainer, module, witness, lines)


def held(run: Run) -> list[Tensor]:
    state = [t for opt in run.trainer.optimizers for t in optimizer_state_tensors(opt)]
    return [*run.module.parameters(), *state, *run.module.buffers()]


def assert_claims_true(run: Run) -> None:
    """Every sentence about the weights is what they are."""
    claims = [line for line in run.lines if "weights intact" in line or "checked finite" in line]
    denials = [line for line in run.lines if "NOT intact" in line]
    if all_finite(held(run)):
        assert not denials
    else:
        assert denials and not any("done at step" in line for line in claims)


SETUPS = {
    "auto": Setup(),
    "accum": Setup(accumulate=2),
    "manual": Setup(manual=True),
    "two-optimizers": Setup(manual=True, optimizers=2),
    "shared-loss": Setup(manual=True, optimizers=2, shared=True),
    "lbfgs": Setup(optimizer="lbfgs"),
    "swa": Setup(trainer={"swa": True}),
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
    ("auto", "none", False),
    ("auto", "loss", True),
    ("auto", "batch", True),
    ("auto", "lm_hook", True),
    ("auto", "lm_hook_data", True),
    ("auto", "cb_before", True),
    ("auto", "cb_after", True),
    ("auto", "lr", True),
    ("auto", "replaced", True),
    ("auto", "clip_hook", True),
    ("accum", "loss", True),
    ("manual", "none", False),
    ("manual", "loss", True),
    ("manual", "lr", True),
    ("two-optimizers", "none", False),
    ("two-optimizers", "grad_b", False),  # the first optimizer steps: not identical
    ("shared-loss", "none", False),
    ("shared-loss", "loss", True),
    ("lbfgs", "none", False),
    ("lbfgs", "loss", True),
    ("swa", "none", False),
    ("swa", "loss", True),
    ("fp64", "none", False),
    ("fp64", "loss", True),
    ("complex", "none", False),
    ("complex", "loss", True),
    ("bf16", "loss", True),
    ("fp16", "loss", True),
    ("fp16", "cb_after", True),
    ("batchnorm", "batch", True),
    ("attention-4d", "none", False),
    ("returns-none", "none", False),
]


@pytest.mark.parametrize(
    ("setup", "fault", "identical"), CASES, ids=[f"{s}-{f}" for s, f, _ in CASES]
)
def test_fault_matrix(
    setup: str, fault: str, identical: bool, caplog: pytest.LogCaptureFixture
) -> None:
    run = fit(SETUPS[setup], fault, caplog)
    assert all_finite(held(run)), "a non-finite value reached the weights, state or buffers"
    assert run.trainer.global_step > 0 and not any("stopping at" in line for line in run.lines)
    assert_claims_true(run)
    kinds = {f.kind for f in run.monitor.findings}
    if fault == "none":
        assert not kinds & {"nonfinite_loss", "nonfinite_grad", "nonfinite_update", "guard_error"}
        assert run.monitor.skipped_steps == 0
    if identical:
        assert run.witness.identical, "the skipped step changed the weights, state or buffers"
        assert run.monitor.skipped_steps >= 1
    if setup == "lbfgs":  # one step per optimizer step, however many closure evaluations
        assert run.monitor.skipped_steps == int(fault != "none")


def test_two_optimizers_skip_only_the_one_with_nan(caplog: pytest.LogCaptureFixture) -> None:
    run = fit(SETUPS["two-optimizers"], "grad_b", caplog)
    guard = run.monitor.guard
    assert guard is not None and guard.skipped == 1  # the second optimizer's step at the fault
    steps = run.trainer.global_step
    assert steps == 2 * BATCHES  # manual optimization counts each optimizer's steps


def test_a_nan_batch_is_named_as_the_input(caplog: pytest.LogCaptureFixture) -> None:
    run = fit(SETUPS["auto"], "batch", caplog)
    (cause,) = [f for f in run.monitor.findings if f.kind == "root_cause"]
    assert "input batch holds NaN/Inf" in cause.message


def test_accumulation_names_the_micro_batch_that_failed(caplog: pytest.LogCaptureFixture) -> None:
    run = fit(SETUPS["accum"], "loss", caplog)
    (cause,) = [f for f in run.monitor.findings if f.kind == "root_cause"]
    # Batch 4 is the first of the two micro-batches of step 2: reproduced, not "transient".
    assert cause.message.startswith("micro-batch 1 of 2:") and "reproduced" in cause.message


def test_the_replay_takes_no_optimizer_step_under_manual_optimization(
    caplog: pytest.LogCaptureFixture,
) -> None:
    run = fit(SETUPS["manual"], "loss", caplog)
    assert run.trainer.global_step == BATCHES  # the replay stepped nothing, counted nothing
    assert run.monitor.root_causes == 1


def test_eps0_updates_are_undone_and_said(caplog: pytest.LogCaptureFixture) -> None:
    run = fit(SETUPS["eps0"], "none", caplog)
    assert all_finite(held(run))
    guard = run.monitor.guard
    assert guard is not None and guard.reverted >= 1
    risks = [f for f in run.monitor.findings if f.kind == "config_risk" and "eps=0" in f.message]
    assert risks and risks[0].severity.name == "WARNING"


def test_a_nan_buffer_is_reported_and_never_called_intact(
    caplog: pytest.LogCaptureFixture,
) -> None:
    run = fit(SETUPS["batchnorm"], "buffer", caplog)
    critical = [f for f in run.monitor.findings if f.severity.name == "CRITICAL"]
    assert critical and "NOT intact" in critical[0].message
    assert "buffer norm.running_mean" in critical[0].message
    assert run.trainer.should_stop
    assert any("NOT intact" in line for line in run.lines)
    assert not any("weights intact" in line for line in run.lines)


def test_a_probe_that_cannot_read_a_module_drops_only_that_signal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fit(SETUPS["attention-4d"], "none", caplog)
    dropped = [r for r in caplog.records if "activation probe" in r.getMessage()]
    assert len(dropped) == 1 and "attn.scores" in dropped[0].getMessage()
