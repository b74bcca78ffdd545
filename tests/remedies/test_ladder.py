"""The ``auto`` policy checks its work: ``remedy_result`` after each remedy, and what comes next.

Driven step by step through ``AutoRemedies.after_step`` with the findings a detector would send
and the step's record, on a real Trainer and optimizer (no fit: the ladder's decisions only).
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch

from stabilizer.callbacks.auto import AutoRemedies
from stabilizer.callbacks.ladder import Ladder, result_finding
from stabilizer.core.records import Finding, Severity, StepRecord


def _trainer(lr: float = 1e-3) -> tuple[pl.Trainer, torch.nn.Module]:
    trainer = pl.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    module = torch.nn.Linear(2, 2)
    trainer.optimizers = [torch.optim.AdamW(module.parameters(), lr=lr)]
    return trainer, module


def _record(step: int, loss: float = 2.0, lr: float = 1e-3) -> StepRecord:
    return StepRecord(step, {"loss": loss, "lr": lr})


def _spike(step: int) -> Finding:
    return Finding("loss_spike", step, step + 4, Severity.WARNING, "spike", {}, (), ("clip",))


def _diverged(step: int, at: int) -> Finding:
    return Finding("divergence", step, at, Severity.ERROR, "loss stays up", {})


def _run(
    auto: AutoRemedies,
    trainer: pl.Trainer,
    module: torch.nn.Module,
    steps: range,
    found: dict[int, list[Finding]],
    **record: float,
) -> list[Finding]:
    out = []
    for s in steps:
        now = found.get(s, [])
        out += auto.after_step(trainer, module, s, now, _record(s, **record))
    return out


def _results(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.kind == "remedy_result"]


def test_a_remedy_whose_failure_stays_away_worked_after_the_window() -> None:
    trainer, module = _trainer()
    auto = AutoRemedies(allow=["clip_gradients"], check_steps=30)
    out = _run(auto, trainer, module, range(155, 200), {155: [_spike(150)]}, loss=2.5)
    (result,) = _results(out)
    assert result.step == 185 and result.severity == Severity.INFO
    assert result.remedies == ("clip_gradients",)
    assert result.evidence == {"loss_before": 2.5, "loss_after": 2.5, "applied_step": 155.0,
                               "worked": 1.0}  # fmt: skip
    assert "worked: no loss_spike back in 30 steps" in result.message


def test_a_later_spike_that_came_back_down_is_not_a_failure_of_clipping() -> None:
    # Bad data still has a high loss with clipping on: the spike is what clipping lets through.
    trainer, module = _trainer()
    auto = AutoRemedies(allow=["clip_gradients"], check_steps=30)
    out = _run(auto, trainer, module, range(155, 200), {155: [_spike(150)], 170: [_spike(165)]})
    assert [f.evidence["worked"] for f in _results(out)] == [1.0]


def test_a_failure_that_comes_back_is_answered_by_the_next_remedy() -> None:
    trainer, module = _trainer()
    auto = AutoRemedies(allow=["clip_gradients", "scale_lr"], check_steps=50)
    found = {155: [_spike(150)], 180: [_diverged(165, 180)]}
    out = _run(auto, trainer, module, range(155, 182), found, loss=7.0)
    (result,) = _results(out)
    assert result.step == 180 and result.severity == Severity.WARNING
    assert result.evidence["worked"] == 0.0
    assert "did not work: divergence at step 165" in result.message
    assert result.message.endswith("next: scale_lr")
    assert [f.remedies[0] for f in out if f.kind == "remedy_applied"] == [
        "clip_gradients",
        "scale_lr",
    ]
    assert auto.lr.factor == 0.5 and not auto.exhausted()


def test_an_episode_from_before_the_remedy_does_not_count_against_it() -> None:
    trainer, module = _trainer()
    auto = AutoRemedies(allow=["clip_gradients", "scale_lr"], check_steps=20)
    found = {155: [_spike(150)], 170: [_diverged(150, 170)]}  # the same event, called later
    out = _run(auto, trainer, module, range(155, 180), found)
    assert [f.evidence["worked"] for f in _results(out)] == [1.0]


def test_nothing_left_to_try_is_a_critical_result_and_a_clean_stop() -> None:
    trainer, module = _trainer()
    auto = AutoRemedies(allow=["clip_gradients"], check_steps=50)
    out = _run(
        auto, trainer, module, range(155, 181), {155: [_spike(150)], 180: [_diverged(170, 180)]}
    )
    (result,) = _results(out)
    assert result.severity == Severity.CRITICAL
    assert "nothing left: stopping the run (tried clip_gradients; lower the LR" in result.message
    assert auto.exhausted()
    assert auto.stop_reason == "clip_gradients did not work and nothing is left to try"


def test_a_rollback_after_an_lr_surge_cuts_the_lr_as_much() -> None:
    trainer, module = _trainer()
    auto = AutoRemedies(allow=["rollback"], snapshot_every=10, check_steps=30)
    auto.start(trainer, module)
    _run(auto, trainer, module, range(0, 31), {}, lr=1e-3)  # snapshots at 10, 20, 30
    out = _run(auto, trainer, module, range(31, 41), {40: [_diverged(35, 40)]}, lr=3.0)
    (rollback,) = [f for f in out if f.kind == "remedy_applied"]
    assert rollback.evidence["restored_step"] == 30.0
    assert rollback.evidence["lr_then"] == 1e-3 and rollback.evidence["lr_now"] == 3.0
    assert auto.lr.factor == pytest.approx(1e-3 / 3.0)
    assert "LR cut 3e+03x" in rollback.message
    # The LR the next steps use is back to the snapshot's: the divergence stays away.
    later = _run(auto, trainer, module, range(41, 80), {}, lr=1e-3)
    (result,) = _results(later)
    assert result.remedies == ("rollback",) and result.evidence["worked"] == 1.0


def test_a_rollback_without_a_surge_keeps_the_lr() -> None:
    trainer, module = _trainer()
    auto = AutoRemedies(allow=["rollback"], snapshot_every=10)
    auto.start(trainer, module)
    _run(auto, trainer, module, range(0, 21), {}, lr=1e-3)
    out = _run(auto, trainer, module, range(21, 26), {25: [_diverged(23, 25)]}, lr=1.5e-3)
    (rollback,) = [f for f in out if f.kind == "remedy_applied"]
    assert "lr_now" not in rollback.evidence and auto.lr.factor == 1.0


def test_a_swap_works_once_the_band_of_starved_blocks_closes() -> None:
    ladder = Ladder(check_steps=10)
    band = Finding("depth_imbalance", 27, 37, Severity.WARNING, "band", {})
    ladder.watch("swap_to_pre_ln", band, 37, 3.2)
    assert ladder.check(47, [], 3.1)[0].worked is False  # still open at the window's end
    ladder.watch("swap_to_pre_ln", band, 37, 3.2)
    closed = Finding("depth_imbalance", 27, 44, Severity.INFO, "back within 100x", {})
    assert ladder.check(44, [closed], 3.0) == []
    (verdict,) = ladder.check(47, [], 2.9)
    assert verdict.worked and verdict.loss == 2.9


def test_a_swap_after_which_the_loss_does_not_fall_did_not_work() -> None:
    # The band closed, but the stack still does not learn: the loss level (median of the last
    # 10) is where it was at the swap. A loss that fell, the same band, worked.
    for after, worked in ((3.25, False), (2.9, True)):
        ladder = Ladder(check_steps=10)
        for step in range(27, 37):
            assert ladder.check(step, [], 3.2 + 0.01 * (step % 2)) == []
        band = Finding("depth_imbalance", 27, 37, Severity.WARNING, "band", {})
        ladder.watch("swap_to_pre_ln", band, 37, 3.2)
        closed = Finding("depth_imbalance", 27, 40, Severity.INFO, "back within 100x", {})
        assert ladder.check(40, [closed], after) == []
        for step in range(41, 47):
            assert ladder.check(step, [], after) == []
        (verdict,) = ladder.check(47, [], after)
        assert verdict.worked is worked
        if not worked:
            seen = result_finding(47, verdict, None, ["swap_to_pre_ln"]).message
            assert (
                "did not work: the loss did not fall (median of the last 10: 3.205 -> 3.25)" in seen
            )


def test_a_nonfinite_loss_at_the_window_end_is_no_success() -> None:
    ladder = Ladder(check_steps=5)
    ladder.watch("rollback", _diverged(10, 20), 20, 9.0)
    (verdict,) = ladder.check(25, [], math.nan)
    assert not verdict.worked


def test_check_steps_must_be_positive() -> None:
    with pytest.raises(ValueError, match="`check_steps` must be >= 1, got 0"):
        Ladder(check_steps=0)


@pytest.mark.parametrize("scheduled", [True, False])
def test_the_end_of_a_warmup_is_no_surge(scheduled: bool) -> None:
    # The snapshot to go back to is from the warmup (LR 1e-3). With a torch scheduler whose own
    # LR is 0.3 (`initial_lr`), a rollback at 0.3 leaves the LR alone; without one, 0.3 is 300x
    # any LR the run had used: a surge, cut.
    trainer, module = _trainer()
    if scheduled:
        trainer.optimizers[0].param_groups[0]["initial_lr"] = 0.3
    auto = AutoRemedies(allow=["rollback"], snapshot_every=10, check_steps=30)
    auto.start(trainer, module)
    _run(auto, trainer, module, range(0, 11), {}, lr=1e-3)  # a snapshot at 10
    out = _run(auto, trainer, module, range(11, 41), {40: [_diverged(12, 40)]}, lr=0.3)
    (rollback,) = [f for f in out if f.kind == "remedy_applied"]
    assert rollback.evidence["restored_step"] == 10.0
    assert ("LR cut" in rollback.message) is not scheduled
    assert auto.lr.factor == pytest.approx(1.0 if scheduled else 1e-3 / 0.3)
