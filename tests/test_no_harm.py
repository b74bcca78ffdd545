"""First, do no harm (#30): ``protect`` judges what a step changed, never what a model holds.

Each test trains a small real model with a real Lightning ``Trainer`` in a shape users write:
a ``-inf`` causal mask kept as a buffer, quantization-aware observers, a running maximum that
starts at ``-inf``, a frozen ``-inf`` Parameter, an unused ``torch.empty`` parameter holding NaN,
a teacher no optimizer owns, a running statistic that starts changing late, optimizer state
written outside the step, a step that keeps Python state (a list, generators, an iterator),
one monitor given to two fits, two optimizers under manual optimization, LBFGS, ``64-true``, two
monitors at once. Healthy ones must run as they would without the monitor; faults must still be
caught.
"""

from __future__ import annotations

import json
import logging
import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.ao.quantization as tq
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from stabilizer.callbacks.monitor import StabilityMonitor
from stabilizer.core.records import Severity
from stabilizer.step.policies import Protect
from stabilizer.step.protect import Protection

VOCAB, T = 16, 6


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Tiny models: one torch thread (see conftest)."""


def tokens(n: int = 48, seed: int = 0) -> DataLoader[tuple[Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randint(0, VOCAB, (n, T), generator=g)), batch_size=4)


class Base(pl.LightningModule):
    """A next-token model on random tokens; subclasses add the idiom under test."""

    def __init__(self, nan_at: int | None = None) -> None:
        super().__init__()
        self.nan_at = nan_at
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def body(self, h: Tensor) -> Tensor:
        return h

    def training_step(self, batch: tuple[Tensor], i: int) -> Tensor:
        (x,) = batch
        logits = self.head(self.body(self.embed(x)))
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        return loss * math.nan if i == self.nan_at else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader[tuple[Tensor, ...]]:
        return tokens()


def seeded(make: Callable[..., Any], *args: Any) -> Any:
    """A model made from seed 0: its twin starts from the same weights."""
    torch.manual_seed(0)
    return make(*args)


def fit(
    module: pl.LightningModule,
    *callbacks: pl.Callback,
    monitor: StabilityMonitor | None = None,
    steps: int = 10,
    precision: str = "32-true",
    caplog: pytest.LogCaptureFixture | None = None,
) -> pl.Trainer:
    torch.manual_seed(0)
    cbs = [*callbacks, *([monitor] if monitor is not None else [])]
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, callbacks=cbs, logger=False, precision=precision,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if caplog is not None:
            with caplog.at_level(logging.INFO, logger="stabilizer"):
                trainer.fit(module)
        else:
            trainer.fit(module)
    return trainer


def same(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    """Bit-identical state dicts, NaN where NaN."""
    return a.keys() == b.keys() and all(
        torch.equal(x.nan_to_num(1.0, 2.0, 3.0), y.nan_to_num(1.0, 2.0, 3.0))
        and torch.equal(x.isnan(), y.isnan())
        for x, y in ((a[k], b[k]) for k in a)
    )


def warnings_and_worse(monitor: StabilityMonitor) -> list[str]:
    return [f"{f.kind}: {f.message}" for f in monitor.findings if f.severity >= Severity.WARNING]


# --- 1. non-finite by design is not corruption ----------------------------------------------


class CausalMask(Base):
    """PyTorch's documented causal mask, a float buffer with -inf above the diagonal."""

    def __init__(self, nan_at: int | None = None) -> None:
        super().__init__(nan_at)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(T))

    def body(self, h: Tensor) -> Tensor:
        out: Tensor = self.layer(h, src_mask=self.mask, is_causal=True)
        return out


class RunningMax(Base):
    """A running maximum of the loss, starting at -inf (the console's "best so far")."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("best", torch.tensor(-math.inf))

    def training_step(self, batch: tuple[Tensor], i: int) -> Tensor:
        loss = super().training_step(batch, i)
        self.best = torch.maximum(self.best, loss.detach())
        return loss


class FrozenInfParam(Base):
    """A fixed additive mask kept as a frozen Parameter (it is in the optimizer's groups)."""

    def __init__(self) -> None:
        super().__init__()
        self.bias_mask = nn.Parameter(torch.triu(torch.full((T, T), -math.inf), 1), False)

    def body(self, h: Tensor) -> Tensor:
        att = torch.softmax(h @ h.transpose(1, 2) + self.bias_mask, -1)  # (B, T, T)
        return att @ h


class UnusedEmpty(Base):
    """An unused parameter made with torch.empty that happens to hold NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Parameter(torch.full((5,), math.nan))


class QAT(Base):
    """A quantization-aware head: the observers start with min +inf, max -inf."""

    def __init__(self) -> None:
        super().__init__()
        head = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, VOCAB))
        head.qconfig = tq.get_default_qat_qconfig("fbgemm")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.head = tq.prepare_qat(head.train())


IDIOMS: dict[str, Callable[[], pl.LightningModule]] = {
    "causal-mask-buffer": CausalMask,
    "running-max": RunningMax,
    "frozen-inf-parameter": FrozenInfParam,
    "unused-empty-nan": UnusedEmpty,
    "qat-observers": QAT,
}


@pytest.mark.parametrize("idiom", list(IDIOMS))
def test_what_a_model_holds_by_design_is_noted_never_judged(idiom: str) -> None:
    twin = seeded(IDIOMS[idiom])
    fit(twin)
    module, monitor = seeded(IDIOMS[idiom]), StabilityMonitor(jsonl=False)
    trainer = fit(module, monitor=monitor)
    assert not warnings_and_worse(monitor), warnings_and_worse(monitor)
    assert trainer.global_step == 10 and not trainer.should_stop
    assert monitor.skipped_steps == 0
    assert same(module.state_dict(), twin.state_dict())  # as it would have ended without us
    held = [f for f in monitor.findings if f.kind == "nonfinite_held"]
    if idiom != "qat-observers":  # (observers may see their first batch before the check)
        assert held and all(f.severity == Severity.INFO for f in held)
        assert "not judged" in held[0].message


def test_a_finite_value_that_turns_nonfinite_in_a_masked_buffer_is_critical() -> None:
    class Corrupt(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
            if trainer.global_step == 4:
                module.mask[2, 1] = math.nan  # below the diagonal: a finite 0 until now

    module, monitor = CausalMask(), StabilityMonitor(jsonl=False)
    trainer = fit(module, Corrupt(), monitor=monitor)
    critical = [f for f in monitor.findings if f.severity == Severity.CRITICAL]
    assert critical and "buffer mask" in critical[0].message and critical[0].step == 4
    assert trainer.should_stop and trainer.global_step == 5  # (Lightning counts the skipped step)


def test_a_nan_step_of_a_model_with_a_mask_is_skipped_and_named() -> None:
    module, monitor = CausalMask(nan_at=3), StabilityMonitor(jsonl=False)
    trainer = fit(module, monitor=monitor)
    assert monitor.skipped_steps == 1 and not trainer.should_stop
    (cause,) = [f for f in monitor.findings if f.kind == "root_cause"]
    assert "weights" not in cause.message  # the mask is no cause


# --- 2. a NaN gradient on a parameter no optimizer owns ---------------------------------------


class Distill(Base):
    """A student trained against a teacher that no optimizer owns, whose gradient is NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = nn.Linear(8, VOCAB)
        self.teacher.weight.register_hook(lambda g: g * math.nan)

    def training_step(self, batch: tuple[Tensor], i: int) -> Tensor:
        (x,) = batch
        h = self.embed(x)
        student, teacher = self.head(h), self.teacher(h)
        return F.mse_loss(student, teacher.detach()) + 1e-3 * teacher.pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([*self.embed.parameters(), *self.head.parameters()], lr=1e-2)


def test_a_nan_gradient_no_optimizer_applies_skips_nothing() -> None:
    module, monitor = Distill(), StabilityMonitor(jsonl=False)
    trainer = fit(module, monitor=monitor)
    assert monitor.skipped_steps == 0 and not trainer.should_stop
    assert trainer.global_step == 10
    steps = [float(s["step"]) for s in trainer.optimizers[0].state.values()]
    assert steps and all(s == 10 for s in steps)


# --- 3. a buffer that starts changing late --------------------------------------------------


class LateStat(Base):
    """A running statistic refreshed in place every other batch, only after a warm-up."""

    def __init__(self, nan_at: int) -> None:
        super().__init__(nan_at)
        self.register_buffer("stat", torch.zeros(8))

    def body(self, h: Tensor) -> Tensor:
        step = self.trainer.global_step
        if step >= 4 and step % 2 == 0:
            with torch.no_grad():
                self.stat.mul_(0.9).add_(0.1 * h.mean((0, 1)))
        return h

    def training_step(self, batch: tuple[Tensor], i: int) -> Tensor:
        (x,) = batch
        if i == self.nan_at:
            x = x.clone()
        h = self.embed(x)
        if i == self.nan_at:
            h = h * math.nan  # a NaN batch: the statistic takes it in, then the loss is NaN
        logits = self.head(self.body(h))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())


class Witness(pl.Callback):
    """Copies the buffers before step `at` and compares after it."""

    def __init__(self, at: int) -> None:
        self.at, self.before, self.identical = at, dict[str, Tensor](), None

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
        if trainer.global_step == self.at:
            self.before = {k: v.clone() for k, v in module.state_dict().items()}

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
        if self.before and self.identical is None:
            self.identical = same(self.before, module.state_dict())


def test_a_buffer_that_starts_changing_late_is_put_back_when_its_step_is_skipped() -> None:
    module, monitor, witness = LateStat(nan_at=8), StabilityMonitor(jsonl=False), Witness(8)
    trainer = fit(module, witness, monitor=monitor)
    assert monitor.skipped_steps == 1 and witness.identical
    assert torch.isfinite(module.stat).all() and not trainer.should_stop


# --- 4. optimizer state corrupted outside the step -------------------------------------------


class StateNaN(pl.Callback):
    """A NaN written into Adam's second moment of the head's weight after step `after`."""

    def __init__(self, after: int) -> None:
        self.after = after

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
        if trainer.global_step == self.after:
            opt = trainer.optimizers[0]
            opt.state[module.head.weight]["exp_avg_sq"].view(-1)[0] = math.nan


@pytest.mark.parametrize("after", [3, 4, 5, 6])
def test_optimizer_state_corrupted_outside_the_step_never_reaches_the_weights(after: int) -> None:
    module, monitor = Base(), StabilityMonitor(jsonl=False)
    trainer = fit(module, StateNaN(after), monitor=monitor)
    assert all(torch.isfinite(p).all() for p in module.parameters())
    critical = [f for f in monitor.findings if f.severity == Severity.CRITICAL]
    assert critical and critical[0].step == after and "NOT intact" in critical[0].message
    assert "optimizer 0's state" in critical[0].message and trainer.should_stop


# --- 5. the replay leaves no trace in the user's state ----------------------------------------


class Stateful(Base):
    """A step that keeps Python state: the epoch-end list, two generators, an iterator."""

    def __init__(self, nan_at: int) -> None:
        super().__init__(nan_at)
        self.outputs: list[Tensor] = []
        self.noise = torch.Generator().manual_seed(1)
        self.rng = np.random.default_rng(2)
        self.unlabeled: Iterator[list[Tensor]] = iter(tokens(400, seed=3))
        self.drawn: list[int] = []

    def training_step(self, batch: tuple[Tensor], i: int) -> Tensor:
        (x,) = batch
        (extra,) = next(self.unlabeled)
        self.drawn.append(int(extra.sum()))
        h = self.embed(x) + 0.01 * torch.randn((*x.shape, 8), generator=self.noise)
        h = h * float(self.rng.uniform(0.9, 1.1)) + 0.0 * self.embed(extra).mean()
        logits = self.head(h)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        loss = loss * math.nan if i == self.nan_at else loss
        self.outputs.append(loss.detach())
        return loss


def test_the_root_cause_replay_leaves_no_trace_in_the_users_state() -> None:
    runs = {}
    for root_cause in (True, False):
        module, monitor = (
            Stateful(nan_at=4),
            StabilityMonitor(Protect(root_cause=root_cause), jsonl=False),
        )
        fit(module, monitor=monitor)
        assert monitor.root_causes == int(root_cause)
        runs[root_cause] = module
    replayed, plain = runs[True], runs[False]
    assert len(replayed.outputs) == len(plain.outputs) == 10
    assert replayed.drawn == plain.drawn  # no item of the iterator lost
    assert same(replayed.state_dict(), plain.state_dict())


# --- 6. one monitor, two runs -----------------------------------------------------------------


class Boom(pl.Callback):
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 3:
            raise RuntimeError("interrupted")


def test_one_monitor_given_to_two_fits_starts_each_clean(tmp_path: Path) -> None:
    path = tmp_path / "stability.jsonl"
    monitor = StabilityMonitor(jsonl=path)
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(Base(nan_at=1), Boom(), monitor=monitor)
    assert monitor.skipped_steps == 1
    fit(Base(), monitor=monitor, steps=5)  # the second fit: healthy, from the same monitor
    assert monitor.skipped_steps == 0
    assert not [f for f in monitor.findings if f.kind.startswith("nonfinite")]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    runs = [i for i, line in enumerate(lines) if line["type"] == "run"]
    assert len(runs) == 2  # the second run's header, records and end line are written
    second = lines[runs[1] :]
    assert [line["step"] for line in second if line["type"] == "step"] == list(range(5))
    assert second[-1]["type"] == "end" and second[-1]["skipped"] == 0


# --- 7. manual optimization, LBFGS, 64-true, two monitors -------------------------------------


class TwoOptimizers(Base):
    """Manual optimization: one optimizer per half of the model, two losses."""

    def __init__(self, nan_at: int | None, second_nan_from: int | None = None) -> None:
        super().__init__(nan_at)
        self.automatic_optimization = False
        self.second_nan_from = second_nan_from

    def training_step(self, batch: tuple[Tensor], i: int) -> None:
        first, second = self.optimizers()  # type: ignore[misc]
        loss = super().training_step(batch, i)
        first.zero_grad()
        self.manual_backward(loss)
        first.step()
        (x,) = batch
        other = self.head(self.embed(x)).pow(2).mean()
        if self.second_nan_from is not None and i >= self.second_nan_from:
            other = other * math.nan
        second.zero_grad()
        self.manual_backward(other)
        second.step()

    def configure_optimizers(self) -> Any:
        return [
            torch.optim.AdamW(self.embed.parameters(), lr=1e-2),
            torch.optim.AdamW(self.head.parameters(), lr=1e-2),
        ]


def test_two_optimizers_each_count_their_own_steps_around_a_nan() -> None:
    module, monitor = TwoOptimizers(nan_at=3), StabilityMonitor(jsonl=False)
    trainer = fit(module, monitor=monitor, steps=20)
    first, second = trainer.optimizers
    counts = [{float(s["step"]) for s in opt.state.values()} for opt in (first, second)]
    assert counts == [{9.0}, {10.0}]  # the first skipped its NaN step, the second did not
    assert monitor.skipped_steps == 1 and trainer.global_step == 20
    # Each optimizer's losses are a stream of their own: no "spike" between the two levels.
    assert {f.kind for f in monitor.findings if f.severity >= Severity.WARNING} == {
        "nonfinite_loss",
        "root_cause",
    }


def test_a_second_optimizer_that_stays_nan_stops_the_run_by_its_own_count() -> None:
    # Its steps alternate with the first optimizer's healthy ones: each counts its own.
    module, monitor = TwoOptimizers(None, second_nan_from=2), StabilityMonitor(jsonl=False)
    trainer = fit(module, monitor=monitor, steps=40)
    assert trainer.should_stop and trainer.global_step < 40
    runtime = monitor.run.runtime if monitor.run is not None else None
    assert isinstance(runtime, Protection) and runtime.bad_runs == {0: 0, 1: 10}


class LBFGSNet(Base):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)


def test_lbfgs_names_the_loss_not_the_weights_and_finishes() -> None:
    module, monitor = LBFGSNet(nan_at=3), StabilityMonitor(jsonl=False)
    trainer = fit(module, monitor=monitor, steps=6)
    assert trainer.global_step == 6 and monitor.skipped_steps == 1
    (cause,) = [f for f in monitor.findings if f.kind == "root_cause"]
    assert "weights" not in cause.message and "only the loss" in cause.message


class Huge(Base):
    """A 64-true run whose loss carries a finite 1e300 at one step (an offset: same gradient)."""

    def training_step(self, batch: tuple[Tensor], i: int) -> Tensor:
        loss = super().training_step(batch, i)
        return loss + 1e300 if i == 3 else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def test_a_finite_1e300_loss_of_a_64_true_run_is_finite(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    monitor = StabilityMonitor(jsonl=path)
    fit(Huge().double(), monitor=monitor, precision="64-true", steps=6)
    assert monitor.skipped_steps == 0
    assert not [f for f in monitor.findings if f.kind.startswith("nonfinite")]
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    losses = [s["values"]["loss"] for s in steps if s["type"] == "step"]
    assert losses[3] == pytest.approx(1e300)


def test_two_monitors_leave_no_wrapper_on_the_optimizer() -> None:
    first = StabilityMonitor(policy="auto", jsonl=False)
    second = StabilityMonitor(jsonl=False)
    trainer = fit(Base(), first, monitor=second, steps=4)
    (opt,) = trainer.optimizers
    assert "step" not in opt.__dict__
