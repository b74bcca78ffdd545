"""The fault matrix's Lightning part: faults at Lightning's own hook points, on a real Trainer.

The step itself is tried in ``tests/test_fault_matrix.py`` (a plain loop, no Trainer; its
docstring tables which setup x fault pairs run where). Here, each case is a real Lightning fit
of a tiny model with ``protect``, for what only Lightning's hooks can do: a NaN gradient written
in a callback listed before the monitor (``cb_before``) or after it (``cb_after``, which makes
the guard count again), in the module's own ``on_before_optimizer_step`` in place
(``lm_hook``) and through ``.data`` (``lm_hook_data``), in its ``configure_gradient_clipping``
(``clip_hook``: 0/0 on all-zero gradients); an optimizer replaced in ``trainer.optimizers``
mid-run (``replaced``); SWA's wrapping of the optimizer; manual optimization's
``manual_backward`` and its step counting; ``training_step`` returning ``None``; and Lightning's
replay of ``training_step`` for the root cause (a NaN batch, a micro-batch of an accumulation).
Every case asserts what the protection promises: parameters, optimizer state and buffers end
finite; a step that held the fault left them bit-identical; a healthy run is not stopped; every
claim the console made about the weights is true.
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


@dataclass
class Setup:
    manual: bool = False
    optimizers: int = 1  # manual: 2 = two losses (GAN-like), each optimizer its own
    precision: str = "32-true"
    accumulate: int = 1
    returns_none: bool = False
    trainer: dict[str, Any] = field(default_factory=dict)


class Net(pl.LightningModule):
    def __init__(self, setup: Setup, fault: str) -> None:
        super().__init__()
        self.setup_, self.fault = setup, fault
        self.automatic_optimization = not setup.manual
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 1)
        self.frozen_zero = nn.Parameter(torch.ones(3))  # its gradient is always exactly 0

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.relu(self.a(x))) + 0.0 * self.frozen_zero.sum()

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
        if self.setup_.optimizers == 2:
            return [
                torch.optim.AdamW([*self.a.parameters(), self.frozen_zero], lr=1e-2),
                torch.optim.AdamW(self.b.parameters(), lr=1e-2),
            ]
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

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
    """Faults a callback puts in: a gradient before/after the monitor, a NaN batch, an optimizer
    replaced mid-run."""

    def __init__(self, fault: str) -> None:
        self.fault = fault

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, i: int) -> None:
        if i == FAULT and self.fault == "batch":
            batch[0][0, 0] = math.nan  # the batch as the data loader handed it over
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
    monitor = StabilityMonitor(jsonl=False)
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
    "swa": Setup(trainer={"swa": True}),
    "bf16": Setup(precision="bf16-mixed"),
    "returns-none": Setup(returns_none=True),
}

# (setup, fault, the fault's step is skipped and leaves everything bit-identical)
CASES = [
    ("auto", "none", False),
    ("auto", "loss", True),
    ("auto", "cb_before", True),
    ("auto", "cb_after", True),
    ("auto", "lm_hook", True),
    ("auto", "lm_hook_data", True),
    ("auto", "clip_hook", True),
    ("auto", "replaced", True),
    ("manual", "none", False),
    ("swa", "none", False),
    ("swa", "loss", True),
    ("bf16", "cb_after", True),  # (Lightning's 16-mixed on the CPU is bf16-mixed)
    ("returns-none", "none", False),
]


@pytest.mark.parametrize(
    ("setup", "fault", "identical"), CASES, ids=[f"{s}-{f}" for s, f, _ in CASES]
)
def test_fault_matrix(
    setup: str, fault: str, identical: bool, caplog: pytest.LogCaptureFixture
) -> None:
    assert_promise(fit(SETUPS[setup], fault, caplog), fault, identical)


def assert_promise(run: Run, fault: str, identical: bool) -> None:
    """What the protection promises (the module docstring)."""
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


def _cause(run: Run) -> str:
    (cause,) = [f for f in run.monitor.findings if f.kind == "root_cause"]
    return cause.message


def test_two_optimizers_skip_only_the_one_with_nan(caplog: pytest.LogCaptureFixture) -> None:
    run = fit(SETUPS["two-optimizers"], "grad_b", caplog)
    assert_promise(run, "grad_b", identical=False)  # the first optimizer steps: not identical
    guard = run.monitor.guard
    assert guard is not None and guard.skipped == 1  # the second optimizer's step at the fault
    assert run.trainer.global_step == 2 * BATCHES  # manual optimization counts each optimizer's


def test_the_replay_takes_no_optimizer_step_under_manual_optimization(
    caplog: pytest.LogCaptureFixture,
) -> None:
    run = fit(SETUPS["manual"], "loss", caplog)
    assert_promise(run, "loss", identical=True)
    assert run.trainer.global_step == BATCHES  # the replay stepped nothing, counted nothing
    assert run.monitor.root_causes == 1


def test_a_nan_batch_is_named_as_the_input(caplog: pytest.LogCaptureFixture) -> None:
    run = fit(SETUPS["auto"], "batch", caplog)
    assert_promise(run, "batch", identical=True)
    assert "input batch holds NaN/Inf" in _cause(run)


def test_accumulation_names_the_micro_batch_that_failed(caplog: pytest.LogCaptureFixture) -> None:
    run = fit(SETUPS["accum"], "loss", caplog)
    assert_promise(run, "loss", identical=True)
    # Batch 4 is the first of the two micro-batches of step 2: reproduced, not "transient".
    assert _cause(run).startswith("micro-batch 1 of 2:") and "reproduced" in _cause(run)
