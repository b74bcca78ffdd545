"""`FairseqReader`: train_inner (simple and json), valid lines, the fp16 scaler's messages."""

from __future__ import annotations

import math

from reader_cases import findings, kinds, parse, records, serious

from stabilizer.core.records import StepRecord
from stabilizer.replay.readers import Note

LOG = """\
2024-01-01 12:00:00 | INFO | fairseq.trainer | NOTE: gradient overflow detected, ignoring \
gradient, setting loss scale to: 64.0
2024-01-01 12:00:10 | INFO | train_inner | epoch 001:    100 / 1000 loss=9.123, nll_loss=9.0, \
ppl=512, wps=12345, ups=1.2, wpb=4000, bsz=128, num_updates=100, lr=0.0005, gnorm=1.234, \
clip=20, loss_scale=64, train_wall=80, gb_free=10.1, wall=90
2024-01-01 12:00:20 | INFO | train_inner | {"epoch": 1, "update": 0.2, "loss": "8.9", \
"num_updates": "200", "gnorm": "nan"}
2024-01-01 12:00:30 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 8.5 | nll_loss \
8.4 | ppl 338 | wps 5000 | wpb 4000 | bsz 100 | num_updates 200
| epoch 001:    300 / 1000 loss=8.8, num_updates=300, lr=0.0005
FloatingPointError: Minimum loss scale reached (0.0001). Your loss is probably exploding.
"""


def test_lines_map_to_signals() -> None:
    notes: list[Note] = []
    recs = parse("fairseq", LOG, notes)
    assert recs[0] == StepRecord(1, {"skipped": 1.0, "loss_scale": 128.0})  # the scale in force
    assert recs[1] == StepRecord(
        100,
        {"loss": 9.123, "nll_loss": 9.0, "lr": 5e-4, "grad_norm": 1.234, "clipped": 0.2,
         "loss_scale": 64.0},
    )  # fmt: skip
    assert recs[2].values["loss"] == 8.9 and math.isnan(recs[2].values["grad_norm"])
    assert recs[3] == StepRecord(200, {"val_loss": 8.5})
    assert recs[4] == StepRecord(300, {"loss": 8.8, "lr": 5e-4})  # the pre-hydra layout
    assert recs[5] == StepRecord(301, {"skipped": 1.0, "loss_scale": 1e-4})
    assert [n.message for n in notes] == [
        "fairseq losses are in base 2 (bits), interval means",
        "fairseq stopped: minimum loss scale reached",
    ]


def test_healthy_fixture() -> None:
    recs = records("fairseq_healthy.log")
    assert recs[0] == StepRecord(1, {"skipped": 1.0, "loss_scale": 128.0})
    assert recs[2].step == 20 and recs[2].values["loss_scale"] == 32.0
    assert not serious(findings(recs))


def test_failing_fixture() -> None:
    recs = records("fairseq_failing.log")
    assert recs[-1].values == {"skipped": 1.0, "loss_scale": 1e-4}
    assert kinds(findings(recs)) == {"fp16_overflow"}
