"""`LightningCsvReader`: sparse rows merge by step, aliases, ``grad_2.0_norm`` groups."""

from __future__ import annotations

import math

from reader_cases import findings, kinds, parse, parse_items, records, restarts, serious

from stabilizer.replay.readers import Note

CSV = """epoch,grad_2.0_norm/model.h.0.attn.weight,grad_2.0_norm/model.h.0.mlp.weight,\
grad_2.0_norm/model.h.1.mlp.weight,grad_2.0_norm/model.wte.weight,grad_2.0_norm_total,lr-AdamW,\
step,train_loss_epoch,train_loss_step,val_loss,stability/loss_scale
0,3.0,4.0,1.0,2.0,6.0,0.001,49,,2.5,,1024
0,,,,,,,49,,,2.7,
0,,,,,,,49,2.6,,,
1,,,,,,,99,,nan,,
"""


def test_rows_merge_and_names_map() -> None:
    first, second = parse("lightning_csv", CSV)
    assert first.step == 49 and second.step == 99
    assert first.values == {
        "grad_norm/block_00": 5.0,  # sqrt(3² + 4²): one depth group
        "grad_norm/block_01": 1.0,
        "grad_norm/embed": 2.0,
        "grad_norm": 6.0,
        "lr": 0.001,
        "loss": 2.5,
        "val_loss": 2.7,
        "train_loss_epoch": 2.6,
        "loss_scale": 1024.0,
    }
    assert math.isnan(second.values["loss"])


def test_healthy_fixture() -> None:
    recs = records("lightning_csv_healthy")
    assert len(recs) == 400 and recs[0].step == 0 and recs[-1].step == 399
    assert set(recs[99].values) >= {
        "loss",
        "val_loss",
        "train_loss_epoch",
        "grad_norm/block_05",
        "lr",
    }
    assert recs[0].values["lr"] == 6e-06
    assert not serious(findings(recs))


def test_failing_fixture() -> None:
    assert kinds(findings(records("lightning_csv_failing"))) == {"loss_spike"}


def test_step_back_and_garbage_rows() -> None:
    notes: list[Note] = []
    text = "step,loss\n1,2.0\n2,x\n\n3,2.0,9\n1,2.0\n"
    found = parse_items("lightning_csv", text, notes)
    assert [getattr(item, "step", None) for item in found] == [1, 3, 1, 1]
    assert restarts(found) == [(1, 6, "step went back from 3 to 1")]
    assert not notes


def test_csv_header_changing_within_a_step_merges_by_name() -> None:
    text = "step,train_loss_step,lr-AdamW\n1,2.0,0.1\nstep,loss\n1,3.0\n2,4.0\nstep,loss\n3,5.0\n"
    assert [(r.step, r.values) for r in parse("lightning_csv", text)] == [
        (1, {"loss": 3.0, "lr": 0.1}),
        (2, {"loss": 4.0}),
        (3, {"loss": 5.0}),
    ]


def test_the_one_training_column_that_says_loss_is_the_loss() -> None:
    """A name no alias knows (``train_loss_batch``) is the loss where it is the one training
    column that says loss: its per-step column, not its ``_epoch`` mean; held-out columns and
    a header with an alias of the loss keep their names."""
    text = (
        "epoch,step,train_loss_batch,train_loss_epoch,val_loss_batch\n0,1,2.5,,\n0,2,nan,2.6,3.0\n"
    )
    first, second = parse("lightning_csv", text)
    assert first.values == {"loss": 2.5}
    assert math.isnan(second.values["loss"]) and second.values["train_loss_epoch"] == 2.6
    aliased = "step,loss,aux_loss_batch\n1,2.0,0.5\n"
    assert parse("lightning_csv", aliased)[0].values == {"loss": 2.0, "aux_loss_batch": 0.5}
    two = "step,loss_g,loss_d\n1,2.0,0.5\n"  # a GAN's two losses: neither is the loss
    assert parse("lightning_csv", two)[0].values == {"loss_g": 2.0, "loss_d": 0.5}
    held_out = "step,val_loss_batch\n1,2.0\n"
    assert parse("lightning_csv", held_out)[0].values == {"val_loss_batch": 2.0}


def test_evaluation_rows_with_their_own_counter_are_no_restart() -> None:
    """Lightning logs an evaluation loop's ``on_step`` metrics with the loop's batch counter:
    rows of held-out metrics alone behind the training rows count at the last training step;
    a training row that goes back is still a restart."""
    text = (
        "epoch,step,train_loss_step,val_loss_step\n"
        "0,49,2.9,\n,0,,3.8\n,1,,3.9\n0,99,2.8,\n0,149,2.7,\n0,20,2.6,\n"
    )
    found = parse_items("lightning_csv", text, [])
    assert [getattr(item, "step", None) for item in found] == [49, 99, 149, 20, 20]
    assert found[0].values == {"loss": 2.9, "val_loss": 3.9}
    assert restarts(found) == [(20, 7, "step went back from 149 to 20")]


def test_columns_map_once_a_header_with_percentages_and_norms_merged_by_name() -> None:
    """The keys are worked out once a header: a percentage column (fairseq's ``clip``) lands
    in 0..1; per-parameter norms of one step's rows merge by name (a later row's cell wins)
    before their sum of squares; a row of held-out cells alone, with a dropped column beside
    them, still counts at the last training step."""
    text = (
        "step,train_loss_step,clip,grad_2.0_norm/h.0.mlp.weight,grad_2.0_norm/h.0.attn.weight,"
        "val_loss,stability/finding/loss_spike\n"
        "5,2.0,25,3.0,,,\n5,,,9.0,4.0,,\n6,1.9,,,,,\n2,,,,,3.5,\n"
    )
    found = parse_items("lightning_csv", text, [])
    first, second = found
    assert first.step == 5 and first.values == {
        "loss": 2.0,
        "clipped": 0.25,
        "grad_norm/block_00": math.sqrt(97.0),
    }
    assert second.step == 6 and second.values == {"loss": 1.9, "val_loss": 3.5}
    assert not restarts(found)
