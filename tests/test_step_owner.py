"""#38: one owner per optimizer step — the breakages of setups outside the suite, on every host.

Each test is one setup users run, under every host where it exists (`hosts_harness`: a plain
loop, Fabric, Lightning, the HF Trainer), asserting what the step did rather than what it
inferred: the norm and the clip of unscaled gradients under a grad scaler whatever the
optimizer, a block that never stepped carrying nothing into the next step, no "applied" said
of an update that never ran, an optimizer without a readable LR running healthy, a model
trained in ``eval()`` getting its root cause, ``auto`` using its three rollbacks, a model the
loop never calls itself being watched all the same, a fit continued after an evaluation
counting as one run, a huge finite fp64 gradient staying finite, a resumed HF training
reporting as the whole one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from hosts_harness import Examples, HFModel, Result, Setup, Tiny, batches, hosts, train
from torch import Tensor, nn

from stabilizer.hosts.loop import Stabilizer
from stabilizer.step.policies import Auto, Protect

NAN = {"nonfinite_loss", "nonfinite_grad", "nonfinite_update", "guard_error"}


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Tiny models: one torch thread (see conftest)."""


def _fused(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, fused=True)


def _norms(result: Result) -> list[str]:
    """Each step's logged gradient norm, rounded to 4 significant digits ('inf' as such)."""
    values = [v.get("grad_norm") for _, v in sorted(result.records.items())]
    return [f"{v:.4g}" if isinstance(v, float) else str(v) for v in values]


# --- 1. under a grad scaler, the norm and the clip are of unscaled gradients ----------------


@pytest.mark.parametrize("host", hosts())
def test_a_fused_optimizer_under_a_grad_scaler_logs_the_unscaled_norm(
    host: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Fused AdamW takes the scale itself (the scaler does not unscale before its step): the
    logged norm is still the unscaled one, the same as the foreach AdamW's of the same loop."""
    fused = train(host, Setup(fp16=True, optimizer=_fused), tmp_path / "fused", caplog)
    plain = train(host, Setup(fp16=True), tmp_path / "plain", caplog)
    assert _norms(fused) == _norms(plain)
    assert float(_norms(plain)[0]) < 100  # (the scale is 65536)


@pytest.mark.parametrize("host", hosts("loop", "fabric", "hf"))
def test_a_fused_optimizer_under_a_grad_scaler_is_clipped_unscaled(
    host: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The clip acts on unscaled gradients: the weights end as the foreach AdamW's of the same
    scaler loop that clips after ``unscale_`` (Lightning refuses to clip a fused optimizer
    under its scaler: no such setup there)."""
    fused = train(host, Setup(fp16=True, optimizer=_fused, clip=0.05), tmp_path / "f", caplog)
    plain = train(host, Setup(fp16=True, clip=0.05), tmp_path / "p", caplog)
    assert _norms(fused) == _norms(plain)
    for a, b in zip(fused.weights(), plain.weights(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


class TakesTheScaler(torch.optim.SGD):
    """An optimizer whose ``step`` takes the grad scaler itself (torch's older contract for
    optimizers that unscale inside their step): it unscales, then steps unless inf/NaN."""

    _step_supports_amp_scaling = True

    def step(self, closure: Any = None, grad_scaler: Any = None) -> Any:  # type: ignore[override]
        if grad_scaler is not None:
            grad_scaler.unscale_(self)
            found = sum(v.item() for v in grad_scaler._found_inf_per_device(self).values())
            if found:
                return None
        return super().step(closure)


def test_an_optimizer_that_takes_the_scaler_logs_the_unscaled_norm(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def own(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return TakesTheScaler(params, lr=1e-2)

    def sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=1e-2)

    taking = train("loop", Setup(fp16=True, optimizer=own), tmp_path / "own", caplog)
    plain = train("loop", Setup(fp16=True, optimizer=sgd), tmp_path / "sgd", caplog)
    assert _norms(taking) == _norms(plain)
    for a, b in zip(taking.weights(), plain.weights(), strict=True):
        torch.testing.assert_close(a, b)


# --- 2. a block that never stepped is abandoned: nothing of it carries over -----------------


def _abandoning_loop(tmp: Path, how: str) -> Stabilizer:
    """Eight blocks; block 3 runs its backward on a NaN loss and never steps: the loop
    ``continue``s past it, or its own code raises after the backward and the loop goes on."""
    setup = Setup(nan_at=(3,))
    model = Tiny(setup)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    at = {"step": 0}
    model.step = lambda: at["step"]
    with Stabilizer(model, optimizer, jsonl=tmp / "stability.jsonl") as stab:
        for i, (x, y) in enumerate(batches(setup)):
            at["step"] = i
            try:
                with stab.step():
                    optimizer.zero_grad()
                    loss = model(x, y)
                    stab.backward(loss)
                    if how == "raise" and i == 3:
                        raise ValueError("the loop's own check after the backward")
                    if how == "continue" and not torch.isfinite(loss):
                        continue
                    optimizer.step()
            except ValueError:
                continue
    return stab


@pytest.mark.parametrize("how", ["continue", "raise"])
def test_a_block_that_never_stepped_carries_nothing_into_the_next(
    how: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="stabilizer"):
        stab = _abandoning_loop(tmp_path, how)
    assert stab.skipped_steps == 0 and stab.host.step == 7
    assert not [f for f in stab.findings if f.kind in NAN]  # the loop stepped past its NaN
    lines = [r.getMessage() for r in caplog.records if r.name == "stabilizer"]
    assert any("abandoned" in line for line in lines)  # said as such
    assert "0 steps skipped" in lines[-1]


def test_a_manual_batch_that_never_stepped_carries_nothing_into_the_next(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Under Lightning's manual optimization: a training step backpropagates a NaN loss and
    returns without stepping (its own NaN check)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from stabilizer.callbacks.monitor import StabilityMonitor

    setup = Setup(nan_at=(3,))
    model = Tiny(setup)

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.model = model

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
            opt: Any = self.optimizers()
            opt.zero_grad()
            loss = self.model(*batch)
            self.manual_backward(loss)
            if torch.isfinite(loss):
                opt.step()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    batch_no = {"i": 0}
    model.step = lambda: batch_no["i"]
    monitor = StabilityMonitor(jsonl=False)

    class Count(pl.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
            batch_no["i"] = i

    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Count(), monitor],
    )  # fmt: skip
    with caplog.at_level("INFO", logger="stabilizer"):
        trainer.fit(Lit(), DataLoader(batches(setup), batch_size=None))
    assert monitor.skipped_steps == 0 and trainer.global_step == 7
    assert not [f for f in monitor.findings if f.kind in NAN]
    lines = [r.getMessage() for r in caplog.records if r.name == "stabilizer"]
    assert any("abandoned" in line for line in lines)


# --- 3. no "applied" said of an update that never ran --------------------------------------


def test_a_measured_step_the_loop_skips_itself_is_not_called_applied(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The loop measures before its own clipping (``before_step``), then skips its NaN step."""
    setup = Setup(nan_at=(3,))
    model = Tiny(setup)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    at = {"step": 0}
    model.step = lambda: at["step"]
    with (
        caplog.at_level("INFO", logger="stabilizer"),
        Stabilizer(model, optimizer, jsonl=tmp_path / "s.jsonl") as stab,
    ):
        for i, (x, y) in enumerate(batches(setup)):
            at["step"] = i
            with stab.step():
                loss = model(x, y)
                stab.backward(loss)
                stab.before_step(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                if torch.isfinite(loss):
                    optimizer.step()
                optimizer.zero_grad()
    lines = [r.getMessage() for r in caplog.records if r.name == "stabilizer"]
    assert not any("was applied" in line for line in lines)
    assert any("abandoned" in line for line in lines)
    assert stab.skipped_steps == 0 and stab.host.step == 7


class GAN(nn.Module):
    """A container the loop never calls itself: it calls the generator and the critic. The
    generator's last layer outputs NaN at step `nan_at`."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.g = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        self.d = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.nan_at: int = -1
        self.step = 0
        self.g[2].register_forward_hook(self._fault)

    def _fault(self, module: nn.Module, args: Any, out: Tensor) -> Tensor | None:
        return out * math.nan if self.step == self.nan_at else None

    def generate(self, z: Tensor) -> Tensor:
        out: Tensor = self.g(z)
        return out


def _gan(tmp: Path, nan_at: int, before_step: bool) -> Stabilizer:
    """The critic steps every iteration, the generator every other one (a WGAN's schedule);
    `before_step`: the loop measures each step before its own clipping."""
    gan = GAN()
    gan.nan_at = nan_at
    opt_g = torch.optim.Adam(gan.g.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(gan.d.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with Stabilizer(gan, [opt_g, opt_d], jsonl=tmp / "s.jsonl") as stab:
        for i in range(8):
            gan.step = i
            with stab.step():
                real, z = torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)
                opt_d.zero_grad()
                d_loss = gan.d(gan.generate(z).detach()).mean() - gan.d(real).mean()
                stab.backward(d_loss)
                if before_step:
                    stab.before_step(opt_d)
                opt_d.step()
                if i % 2 == 0:
                    opt_g.zero_grad()
                    g_loss = -gan.d(gan.generate(z)).mean()
                    stab.backward(g_loss)
                    if before_step:
                        stab.before_step(opt_g)
                    opt_g.step()
    return stab


def test_a_gan_the_loop_never_calls_itself_is_checked_and_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The container is never called: its generator and critic are. The preflight runs on
    them and the NaN the generator makes at step 4 is named (no replay of a container call
    that never happened), and only the steps that ran are said to have run."""
    with caplog.at_level("INFO", logger="stabilizer"):
        stab = _gan(tmp_path, nan_at=4, before_step=False)
    causes = [f for f in stab.findings if f.kind == "root_cause"]
    assert [c.location for c in causes] == [("g.2",)]
    lines = [r.getMessage() for r in caplog.records if r.name == "stabilizer"]
    assert not any("was applied" in line for line in lines)
    assert not any("not called" in line for line in lines)


# --- 4. an optimizer whose LR the guard cannot read runs as written -------------------------


def _adafactor(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=None, relative_step=True, scale_parameter=True, warmup_init=True)


@pytest.mark.parametrize("host", hosts())
def test_adafactor_without_an_lr_runs_healthy_under_protect(
    host: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("transformers")
    result = train(host, Setup(optimizer=_adafactor), tmp_path, caplog)
    assert result.skipped == 0 and not [f for f in result.findings if f.kind in NAN]
    assert sorted(result.records) == list(range(8))
    if host == "hf":  # (HF's AdafactorSchedule writes an LR of 0.0 into the groups: a number)
        return
    assert all("lr" not in values for values in result.records.values())
    said = [line for line in result.lines if "learning rate" in line and "cannot" in line]
    assert len(said) == 1  # said once


# --- 5. a model trained in eval() gets its root cause ---------------------------------------


@pytest.mark.parametrize("host", hosts("loop", "fabric", "lightning"))
def test_a_model_trained_in_eval_mode_gets_its_root_cause(
    host: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Frozen-BatchNorm fine-tuning trains the model in ``eval()``: its NaN step is skipped and
    named like any other (HF's Trainer puts the model in ``train()`` at every step: no such
    setup there)."""
    result = train(host, Setup(nan_at=(3,), eval_mode=True), tmp_path, caplog)
    assert result.skipped == 1
    causes = [f for f in result.findings if f.kind == "root_cause"]
    assert len(causes) == 1 and causes[0].step == 3


# --- 6. auto uses its rollbacks on a NaN that persists --------------------------------------


@pytest.mark.parametrize("host", hosts("loop", "lightning"))
def test_auto_rolls_back_up_to_three_times_on_a_persisting_nan(
    host: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """docs/remedies.md: a persisting NaN is rolled back up to `max_rollbacks` (3) times, then
    the run stops, saying so; `stop_after` does not cut in while `auto` still has a remedy."""
    policy = Auto(snapshot_every=5, skip_batches=4, max_rollbacks=3)
    setup = Setup(steps=120, nan_at=tuple(range(30, 120)), policy=policy)
    result = train(host, setup, tmp_path, caplog)
    rollbacks = [f for f in result.findings if f.kind == "remedy_applied" and "rollback" in f.seen]
    assert len(rollbacks) == 3
    stops = [line for line in result.lines if "stopping at" in line]
    assert len(stops) == 1 and "rollback" in stops[0]


# --- 7. left from the round before, under Lightning ------------------------------------------


def test_a_fit_continued_after_an_evaluation_is_one_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """fit -> validate -> fit again on the same Trainer continues the run: the second fit's end
    line counts every step skipped, as the JSONL does, and the findings are the whole run's."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from stabilizer.callbacks.monitor import StabilityMonitor

    setup = Setup(steps=8, nan_at=(3,))
    model = Tiny(setup)

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            loss: Tensor = self.model(*batch)
            return loss

        def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
            self.model(*batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    monitor = StabilityMonitor(jsonl=tmp_path / "s.jsonl")
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor],
        num_sanity_val_steps=0,
    )  # fmt: skip
    model.step = lambda: trainer.global_step % 8  # a NaN at step 3 of each epoch
    data = DataLoader(batches(setup), batch_size=None)
    lit = Lit()
    with caplog.at_level("INFO", logger="stabilizer"):
        trainer.fit(lit, data)
        trainer.validate(lit, data)
        trainer.fit_loop.max_epochs = 2
        trainer.fit(lit, data)
    assert monitor.skipped_steps == 2
    lines = [r.getMessage() for r in caplog.records if r.name == "stabilizer"]
    assert "2 steps skipped" in lines[-1]
    assert [(f.kind, f.step) for f in monitor.findings if f.kind == "nonfinite_loss"] == [
        ("nonfinite_loss", 3),
        ("nonfinite_loss", 11),
    ]
    rows = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in rows if r["type"] == "end"][-1] == 2


@pytest.mark.parametrize("host", hosts("loop", "lightning", "hf"))
def test_a_huge_finite_fp64_gradient_is_no_nan(
    host: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Under 64-true a loss of 1e200 makes finite gradients of ~1e200: a spike, never a NaN
    (their squares overflow even fp64: the norms must not square them as they are). Fabric's
    64-true hands the model's output back in float32 (an inf loss): no such setup there."""

    def sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=1e-210)

    setup = Setup(dtype=torch.float64, scale=1e200, scale_at=4, optimizer=sgd)
    result = train(host, setup, tmp_path, caplog)
    assert not [f for f in result.findings if f.kind in NAN]
    norm = result.records[4]["grad_norm"]
    assert isinstance(norm, float) and 1e199 < norm < 1e202
    assert result.skipped == 0


def test_lbfgs_with_a_nan_inside_its_closure_is_skipped_on_lightning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def lbfgs(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(params, lr=0.1, max_iter=3)

    result = train("lightning", Setup(nan_at=(3,), optimizer=lbfgs), tmp_path, caplog)
    assert result.skipped == 1 and all(torch.isfinite(w).all() for w in result.weights())


# --- resume: the same everywhere, the HF Trainer's included ---------------------------------


def test_a_resumed_hf_training_reports_as_the_whole_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``trainer.train(resume_from_checkpoint=...)``: a NaN episode across the checkpoint turns
    persistent after it; the resumed training finds what the uninterrupted one found, and
    appends to the same JSONL."""
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from stabilizer.hosts.hf import StabilityCallback

    setup = Setup(steps=12, nan_at=tuple(range(3, 10)), policy=Protect(stop_after=None))

    def run(out: Path, resume: bool, max_steps: int) -> StabilityCallback:
        model = Tiny(setup)
        args = TrainingArguments(
            output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4,
            learning_rate=1e-2, lr_scheduler_type="constant", report_to="none",
            save_strategy="steps", save_steps=5, use_cpu=True, disable_tqdm=True,
            logging_steps=1000,
        )  # fmt: skip
        callback = StabilityCallback(setup.policy, preflight=False)
        trainer = Trainer(
            model=HFModel(model), args=args, train_dataset=Examples(setup),
            optimizers=(torch.optim.SGD(model.parameters(), lr=1e-2), None),
            callbacks=[callback],
        )  # fmt: skip
        model.step = lambda: trainer.state.global_step
        trainer.train(resume_from_checkpoint=resume or None)
        return callback

    def said(found: list[Any]) -> list[tuple[Any, ...]]:  # (the replay's time varies)
        return [(f.kind, f.step, f.end_step, f.severity, f.location, f.seen[:60]) for f in found]

    whole = run(tmp_path / "whole", False, 12)
    assert any(f.severity.name == "CRITICAL" for f in whole.findings)
    first = run(tmp_path / "resumed", False, 5)
    assert not any(f.severity.name == "CRITICAL" for f in first.findings)
    resumed = run(tmp_path / "resumed", True, 12)
    assert said(resumed.findings) == said(whole.findings)
    rows = [json.loads(line) for line in (tmp_path / "resumed" / "stability.jsonl").open()]
    assert [r["step"] for r in rows if r["type"] == "step"] == list(range(12))
