"""The ``generic`` format (`UniversalReader`) on the fixtures of the console formats it replaced:
``key=value`` logs, nanoGPT (iter/eval lines) and modded-nanogpt (``nanms`` is not a NaN loss).

The records are those the nanoGPT and modded-nanogpt readers gave, but for one thing: the lines a
step prints (nanoGPT's eval line and its ``iter`` line, modded-nanogpt's train and val lines) make
one record, the later value winning, where those readers made a record of each line.
"""

from __future__ import annotations

import math

from reader_cases import (
    findings,
    items,
    kinds,
    only_records,
    parse,
    parse_items,
    records,
    restarts,
    serious,
)

from stabilizer.core.records import StepRecord
from stabilizer.replay.readers import Note


def test_pairs_and_aliases() -> None:
    text = (
        "2024-05-01 12:00:00 INFO step=120 loss=2.51 gnorm=0.83 lr=3e-4 time=12ms\n"
        "Epoch 3 | iter: 4500 | train/loss: 2.31 | learning_rate: 0.0003\n"
        "12:00:01 WARNING nothing to see step here\n"
    )
    assert parse("generic", text) == [
        StepRecord(120, {"loss": 2.51, "grad_norm": 0.83, "lr": 3e-4}),
        StepRecord(4500, {"loss": 2.31, "lr": 3e-4}),
    ]


def test_fixtures() -> None:
    healthy = records("generic_healthy.log")
    assert [r.step for r in healthy] == list(range(400))  # the config line is no record
    assert healthy[0].values.keys() == {"loss", "grad_norm", "lr", "tokens/s"}
    assert not serious(findings(healthy))
    assert kinds(findings(records("generic_failing.log"))) == {"divergence"}


def test_nanogpt_lines() -> None:
    text = (
        "step 0: train loss 10.9876, val loss 10.9912\n"
        "iter 0: loss 10.9854, time 25432.12ms, mfu -100.00%\n"
        "iter 1: loss nan, time 512.34ms, mfu 30.12%\n"
    )
    recs = parse("generic", text)
    assert recs[0] == StepRecord(0, {"loss": 10.9854, "val_loss": 10.9912})  # the iter loss wins
    assert recs[1].step == 1 and math.isnan(recs[1].values["loss"])
    assert len(recs) == 2


def test_nanogpt_fixtures() -> None:
    healthy = records("nanogpt_healthy.log")
    assert [r.step for r in healthy] == list(range(600))
    assert all("loss" in r.values for r in healthy)
    assert sum("val_loss" in r.values for r in healthy) == 3  # evals at steps 0, 250, 500
    assert not serious(findings(healthy))
    assert kinds(findings(records("nanogpt_failing.log"))) == {"loss_spike"}


def test_nanogpt_resume_and_step_back_make_segments() -> None:
    text = (
        "iter 10: loss 3.0, time 1ms, mfu 1%\niter 20: loss 3.0, time 1ms, mfu 1%\n"
        "Resuming training from out\niter 20: loss 3.0, time 1ms, mfu 1%\n"
        "iter 30: loss 3.0, time 1ms, mfu 1%\niter 5: loss 3.0, time 1ms, mfu 1%\n"
    )
    notes: list[Note] = []
    found = parse_items("generic", text, notes)
    assert [getattr(item, "step", None) for item in found] == [10, 20, 20, 20, 30, 5, 5]
    assert restarts(found) == [
        (20, 4, "resume banner 'Resuming training from out'"),
        (5, 6, "step went back from 30 to 5"),
    ]
    assert not notes


def test_nanogpt_resumed_fixture() -> None:
    found = items("nanogpt_resumed.log")
    assert restarts(found) == [(250, 398, "resume banner 'Resuming training from out'")]
    recs = only_records(found)
    assert [r.step for r in recs] == [*range(380), *range(250, 600)]
    assert not serious(findings(recs))


def test_modded_nanms_is_a_timer_artefact() -> None:
    notes: list[Note] = []
    text = (
        "step:0/1000 val_loss:10.8258 train_time:0ms step_avg:nanms\n"
        "step:1/1000 train_loss:10.8258 train_time:29868ms step_avg:nanms\n"
        "step:2/1000 train_time:30123ms step_avg:nanms\n"
    )
    got = parse("generic", text, notes)
    assert [(r.step, r.values.get("loss"), r.values.get("val_loss")) for r in got] == [
        (0, None, 10.8258),
        (1, 10.8258, None),
    ]  # step 2 prints no metric: no record
    assert all(math.isfinite(v) for r in got for v in r.values.values())
    assert not notes


def test_modded_fixtures() -> None:
    healthy = records("modded_nanogpt_healthy.log")
    assert [r.step for r in healthy] == list(range(501))
    assert all(math.isfinite(v) for r in healthy for v in r.values.values())
    assert not serious(findings(healthy))
    assert kinds(findings(records("modded_nanogpt_failing.log"))) == {"nonfinite_loss"}
