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


def _epochs(scales: list[float], hydra: bool) -> str:
    """An epoch summary and a valid line an epoch, the loss scale of each epoch given."""
    lines, updates = [], 0
    for epoch, scale in enumerate(scales, 1):
        updates += 367
        head = f"2024-01-01 12:{epoch:02d}:00 | INFO | train | " if hydra else "| "
        lines.append(
            f"{head}epoch {epoch:03d} | loss {9 - 0.2 * epoch:.3f} | nll_loss 8.1 | ppl 270 | "
            f"wps 1.2e+06 | ups 2.9 | num_updates {updates} | lr 0.0005 | gnorm 0.366 | "
            f"clip 100% | oom 0 | loss_scale {scale:.3f} | wall {150 * epoch}"
        )
        valid = f"2024-01-01 12:{epoch:02d}:30 | INFO | valid | " if hydra else "| "
        lines.append(f"{valid}epoch {epoch:03d} | valid on 'valid' subset | valid_loss 8.2")
    return "\n".join(lines) + "\n"


CASCADE = [256.0, 256.0, 128.0, 128.0, 64.0, 64.0, 32.0, 16.0, 16.0, 8.0, 4.0, 4.0, 2.0]


def test_epoch_summaries_are_records_at_their_last_update() -> None:
    """Issue #32: a log of epoch summaries (no train_inner line) interleaved with valid lines:
    each summary is a record at its num_updates, with its loss scale."""
    for hydra in (False, True):
        recs = [r for r in parse("fairseq", _epochs(CASCADE, hydra)) if "loss" in r.values]
        assert [r.step for r in recs] == [367 * k for k in range(1, 14)]
        assert [r.values["loss_scale"] for r in recs] == CASCADE
        assert recs[0].values["grad_norm"] == 0.366


def test_a_scale_falling_256_to_2_over_13_epochs_is_a_cascade() -> None:
    for hydra in (False, True):
        found = serious(findings(parse("fairseq", _epochs(CASCADE, hydra))))
        assert {f.kind for f in found} == {"fp16_overflow"}, hydra  # (opened, then updated)
        assert found[-1].evidence["scale_min"] == 2.0
    steady = serious(findings(parse("fairseq", _epochs([2.0] * 13, hydra=False))))
    assert steady == []  # fairseq#506: a large-batch run lives at 2


def test_epoch_summaries_after_train_inner_lines_add_nothing() -> None:
    """Their means over the epoch would repeat what the train_inner lines said, less sharply."""
    inner = (
        "| epoch 001:    100 / 1000 loss=9.1, nll_loss=9.0, num_updates=367, lr=0.0005, "
        "loss_scale=64\n"
    )
    recs = parse("fairseq", inner + _epochs([64.0], hydra=False))
    assert [(r.step, r.values.get("loss")) for r in recs] == [(367, 9.1)]
