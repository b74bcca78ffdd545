"""`GenericReader`: ``key=value`` / ``key: value`` lines with a step-like key."""

from __future__ import annotations

from reader_cases import findings, kinds, parse, records, serious

from stabilizer.core.records import StepRecord


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
    assert [r.step for r in healthy] == list(range(400))
    assert healthy[0].values.keys() == {"loss", "grad_norm", "lr", "tokens/s"}
    assert not serious(findings(healthy))
    assert kinds(findings(records("generic_failing.log"))) == {"divergence"}
