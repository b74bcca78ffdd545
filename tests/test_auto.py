"""Policy ``auto``: findings trigger their remedies in real (tiny) training runs.

Every application is a ``remedy_applied`` finding; no remedy is applied twice in a loop; users
allow or forbid remedies by name. The rescue of the full scenarios is measured by
``benchmarks/rescue.py`` (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import replace

import lightning.pytorch as pl
import pytest
import torch
from test_protect import Fault, assert_intact, tiny, train

from conftest import loop_host
from stabilizer.callbacks.monitor import StabilityMonitor
from stabilizer.core.records import Finding, Severity
from stabilizer.demo.model import Block
from stabilizer.demo.scenarios import Scenario
from stabilizer.live.remedies import FP32LayerNorm
from stabilizer.step.auto import AutoRemedies
from stabilizer.step.monitor import RunMonitor
from stabilizer.step.options import Options
from stabilizer.step.policies import Auto


def applied(monitor: StabilityMonitor) -> list[Finding]:
    return [f for f in monitor.findings if f.kind == "remedy_applied"]


class Window(Fault):
    """NaN activations on steps 10..15: the episode turns critical at its fifth step (14)."""

    def _active(self, trainer: pl.Trainer) -> bool:
        return 10 <= trainer.global_step < 16


def test_persistent_nan_rolls_back_and_steps_past_the_batches() -> None:
    monitor = StabilityMonitor(policy=Auto(snapshot_every=5, skip_batches=8), jsonl=False)
    run = train(replace(tiny("32-true"), steps=40), monitor, Window("activation"))
    assert_intact(run)
    assert run.trainer.global_step == 40  # rescued: the run went on
    (rollback,) = [f for f in applied(monitor) if f.remedies == ("rollback",)]
    assert rollback.step == 14
    assert rollback.evidence == {"restored_step": 5.0, "skip_until": 23.0}
    # Updates skipped: the bad steps 10-14, then 15-22 stepped past after the rollback.
    assert monitor.skipped_steps == 5 + 8


def test_post_ln_without_warmup_is_advice_not_a_swap() -> None:
    # Configuration alone is no failure (#31): the preflight advises, auto changes nothing.
    sc = replace(tiny("32-true"), warmup_steps=0, steps=6)
    sc = replace(sc, model=replace(sc.model, norm_position="post", n_layer=4))
    monitor = StabilityMonitor(policy="auto", jsonl=False)
    run = train(sc, monitor, None)
    assert applied(monitor) == []
    blocks = [m for m in run.module.modules() if isinstance(m, Block)]
    assert blocks and all(b.norm_position == "post" for b in blocks)
    (advice,) = [f for f in monitor.findings if "lr_warmup" in f.remedies]
    assert advice.severity.name == "INFO" and advice.step == 0


def test_fp16_nan_upcasts_norms_and_softmax() -> None:
    monitor = StabilityMonitor(policy="auto", jsonl=False)
    run = train(tiny("fp16"), monitor, Fault("activation"))
    assert_intact(run)
    (up,) = [f for f in applied(monitor) if f.remedies == ("upcast_to_fp32",)]
    assert up.step == 4
    assert all(isinstance(m, FP32LayerNorm) for m in run.module.modules() if type(m).__name__
               .endswith("LayerNorm"))  # fmt: skip
    assert all(m.softmax_fp32 for m in run.module.modules() if hasattr(m, "softmax_fp32"))


def test_no_fp32_upcast_in_an_fp32_run() -> None:
    # Everything already runs in fp32: "now in fp32" would be a remedy that changed nothing.
    monitor = StabilityMonitor(policy="auto", jsonl=False)
    run = train(tiny("32-true"), monitor, Fault("activation"))
    assert_intact(run)
    assert {f.kind for f in monitor.findings} & {"nonfinite_loss", "nonfinite_grad"}
    assert ("upcast_to_fp32",) not in [f.remedies for f in applied(monitor)]


def test_forbidden_remedy_is_not_applied() -> None:
    monitor = StabilityMonitor(policy=Auto(allow=["rollback"]), jsonl=False)
    run = train(tiny("fp16"), monitor, Fault("activation"))
    assert_intact(run)
    assert not applied(monitor)
    assert not any(hasattr(m, "softmax_fp32") and m.softmax_fp32 for m in run.module.modules())


def test_remedy_is_never_applied_twice() -> None:
    class Twice(Fault):
        def _active(self, trainer: pl.Trainer) -> bool:
            return trainer.global_step in (4, 8)

    monitor = StabilityMonitor(policy="auto", jsonl=False)
    train(tiny("fp16"), monitor, Twice("activation"))
    assert len([f for f in monitor.findings if f.kind == "nonfinite_loss"]) == 2
    # The upcast once; the NaN that came back within its window is the ladder's: "did not
    # work", and the next remedy for it (a rollback), never the upcast again.
    assert [f.remedies for f in applied(monitor)] == [("upcast_to_fp32",), ("rollback",)]
    results = [f for f in monitor.findings if f.kind == "remedy_result"]
    assert results and "upcast_to_fp32" in results[0].message
    assert "did not work" in results[0].message


def test_a_divergence_that_came_back_calls_for_no_rollback() -> None:
    back = Finding("divergence", 150, 190, Severity.INFO, "loss back under its band", {})
    auto = AutoRemedies(loop_host(), Auto())
    assert auto.after_step(191, [back]) == []
    assert not auto.should_stop()[0]  # no rollback was wanted (and none could be done)


def test_unknown_remedy_name_is_refused() -> None:
    with pytest.raises(ValueError, match="`allow` must name remedies among clip_gradients"):
        Auto(allow=["clip", "rollback"])


def test_auto_state_rides_in_the_checkpoint_with_its_remedies_in_force() -> None:
    """A resumed run is the run it resumes: the remedies applied, the LR factor, and the
    clipping auto switched on (not in the new process's settings) in force again."""
    run = RunMonitor(loop_host(), Auto(), Options(jsonl=False))
    auto = run.remedies
    assert isinstance(auto, AutoRemedies)
    spike = Finding("loss_spike", 150, 154, Severity.WARNING, "spike", {}, (), ("clip_gradients",))
    auto.after_step(155, [spike])
    auto.lr.scale(0.5)
    fresh = loop_host()  # (a new process: its clipping is the user's, none)
    other = RunMonitor(fresh, Auto(), Options(jsonl=False), resumed=run.state_dict())
    other.start()
    assert other.applied == {"clip_gradients": 1} and other.remedies.lr_factor == 0.5
    assert fresh.clip == 1.0


def test_loss_spike_turns_clipping_on_once() -> None:
    host = loop_host()
    auto = AutoRemedies(host, Auto(allow=["clip_gradients"]))
    spike = Finding("loss_spike", 150, 154, Severity.WARNING, "spike", {}, (), ("clip_gradients",))
    (done,) = auto.after_step(155, [spike])
    assert host.clip == 1.0
    assert done.kind == "remedy_applied" and done.evidence["after"] == 1.0
    assert auto.after_step(200, [replace(spike, step=199)]) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "remedy"),
    [("spike", "clip_gradients"), ("nan", "upcast_to_fp32"), ("post-ln-deep", "swap_to_pre_ln")],
)
def test_scenario_with_auto_ends_finite_and_learning(name: str, remedy: str) -> None:
    from stabilizer.callbacks.demo.run import run_scenario

    monitor = StabilityMonitor(policy="auto", jsonl=False)
    run = run_scenario(name, accelerator="cpu", callbacks=[monitor])
    assert_intact(run)
    assert run.trainer.global_step == run.scenario.steps
    assert remedy in [f.remedies[0] for f in applied(monitor)]
    losses = run.trainer.callback_metrics
    assert float(losses["val/loss"]) < 3.3  # learning: the unigram entropy of the corpus is 3.25


class Starve(pl.Callback):
    """From step 8 on, blocks 0-2 get 1e-8 of their gradient: a band starved as post-LN's is."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            return grad * 1e-8 if trainer.global_step >= 8 else grad

        for name, p in pl_module.named_parameters():
            if any(f"blocks.{i}." in name for i in range(3)):
                p.register_hook(hook)


def _post_ln(steps: int = 30) -> Scenario:
    sc = replace(tiny("32-true"), steps=steps, warmup_steps=10)  # with warmup: no swap at step 0
    return replace(sc, model=replace(sc.model, norm_position="post", n_layer=6))


@pytest.mark.parametrize(
    ("allow", "keep", "restored"),
    [
        (None, 4, 0),  # snapshots of steps 0, 5, 10, 15: the oldest, as far back as held
        (None, 2, None),  # 10 and 15: none from before the band, the swap is made in place
        (["swap_to_pre_ln"], 4, None),  # no rollback allowed: no snapshots
    ],
    ids=["oldest-snapshot", "none-before-the-band", "no-rollback"],
)
def test_a_starved_band_restarts_from_the_oldest_snapshot_as_pre_ln(
    allow: list[str] | None, keep: int, restored: int | None
) -> None:
    monitor = StabilityMonitor(
        policy=Auto(snapshot_every=5, keep_snapshots=keep, allow=allow), jsonl=False
    )
    run = train(_post_ln(), monitor, Starve())
    assert_intact(run)
    bands = [f for f in monitor.findings if f.kind == "depth_imbalance"]
    band = bands[0]
    assert band.step == 8 and band.end_step == 17  # the extreme rule: ten records
    (swap,) = [f for f in applied(monitor) if f.remedies == ("swap_to_pre_ln",)]
    assert swap.step == 17
    blocks = [m for m in run.module.modules() if isinstance(m, Block)]
    assert len(blocks) == 6 and all(b.norm_position == "pre" for b in blocks)
    if restored is not None:
        assert swap.evidence["restored_step"] == restored
        assert f"restarted from step {restored}'s weights and optimizer state" in swap.message
    else:
        assert "restored_step" not in swap.evidence and "restarted" not in swap.message
