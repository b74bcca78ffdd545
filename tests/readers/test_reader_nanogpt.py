"""`NanoGptReader` and `ModdedNanoGptReader`: iter/eval lines; ``nanms`` is not a NaN loss."""

from __future__ import annotations

import math

from reader_cases import findings, kinds, parse, parse_items, records, restarts, serious

from stabilizer.core.records import StepRecord
from stabilizer.replay.readers import Note


def test_nanogpt_lines() -> None:
    text = (
        "step 0: train loss 10.9876, val loss 10.9912\n"
        "iter 0: loss 10.9854, time 25432.12ms, mfu -100.00%\n"
        "iter 1: loss nan, time 512.34ms, mfu 30.12%\n"
    )
    recs = parse("nanogpt", text)
    assert recs[0] == StepRecord(0, {"eval_train_loss": 10.9876, "val_loss": 10.9912})
    assert recs[1] == StepRecord(0, {"loss": 10.9854})
    assert math.isnan(recs[2].values["loss"])


def test_nanogpt_fixtures() -> None:
    healthy = records("nanogpt_healthy.log")
    assert len([r for r in healthy if "loss" in r.values]) == 600
    assert not serious(findings(healthy))
    assert kinds(findings(records("nanogpt_failing.log"))) == {"loss_spike"}


def test_nanogpt_resume_and_step_back_make_segments() -> None:
    text = (
        "iter 10: loss 3.0, time 1ms, mfu 1%\niter 20: loss 3.0, time 1ms, mfu 1%\n"
        "Resuming training from out\niter 20: loss 3.0, time 1ms, mfu 1%\n"
        "iter 30: loss 3.0, time 1ms, mfu 1%\niter 5: loss 3.0, time 1ms, mfu 1%\n"
    )
    notes: list[Note] = []
    found = parse_items("nanogpt", text, notes)
    assert [getattr(item, "step", None) for item in found] == [10, 20, 20, 20, 30, 5, 5]
    assert restarts(found) == [
        (20, 4, "resume banner 'Resuming training from out'"),
        (5, 6, "step went back from 30 to 5"),
    ]
    assert not notes


def test_nanogpt_resumed_fixture() -> None:
    recs = records("nanogpt_resumed.log")
    assert len(recs) == 734 and recs[0].step == 0 and recs[-1].step == 599
    assert not serious(findings(recs))


def test_modded_nanms_is_a_timer_artefact() -> None:
    notes: list[Note] = []
    text = (
        "step:0/1000 val_loss:10.8258 train_time:0ms step_avg:nanms\n"
        "step:1/1000 train_loss:10.8258 train_time:29868ms step_avg:nanms\n"
        "step:2/1000 train_time:30123ms step_avg:nanms\n"
    )
    assert parse("modded_nanogpt", text, notes) == [
        StepRecord(0, {"val_loss": 10.8258}),
        StepRecord(1, {"loss": 10.8258}),
    ]
    assert not notes


def test_modded_fixtures() -> None:
    healthy = records("modded_nanogpt_healthy.log")
    assert all(math.isfinite(v) for r in healthy for v in r.values.values())
    assert not serious(findings(healthy))
    assert kinds(findings(records("modded_nanogpt_failing.log"))) == {"nonfinite_loss"}
