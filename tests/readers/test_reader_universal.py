"""`UniversalReader`: the step, the metrics, the aliases, overflows, and what it must survive."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stabilizer.core.records import StepRecord
from stabilizer.replay.readers._lines import text_lines
from stabilizer.replay.readers.aliases import ALIASES
from stabilizer.replay.readers.base import Note, Restart
from stabilizer.replay.readers.universal import UniversalReader, unreadable_message
from stabilizer.replay.readers.universal.tables import numbered_blocks
from stabilizer.replay.readers.universal.values import key_of


def items(text: str) -> list[StepRecord | Restart]:
    """What the reader makes of ``text``, read from bytes as `read_log` reads a file."""
    lines = text_lines(io.BytesIO(text.encode()), [])
    return list(UniversalReader().read_lines(lines))


def records(text: str) -> list[StepRecord]:
    return [item for item in items(text) if isinstance(item, StepRecord)]


def steps(text: str) -> list[int]:
    return [r.step for r in records(text)]


@pytest.mark.parametrize(
    ("line", "step"),
    [
        ("step 12 loss 2.0", 12),
        ("Step 0: loss=3.98", 0),
        ("global_step=77 loss=1", 77),
        ("iter 100: loss 2.3456, time 12.34ms, mfu 30.00%", 100),
        ("iteration    42780/ 115311 | lm loss: 2.1E+00 |", 42780),
        ("| epoch 001:    200 / 1374 loss=14.351, num_updates=190, lr=4.8e-06", 190),
        ("update 9 | loss 2.0", 9),
        ("ep: 0, batch: 20, time: 9.17, loss: 10.98", 20),
        ("[2018-11-26 15:06:01,481 INFO] Step 5650/50000; acc: 0.19; xent: nan", 5650),
        ("iter 8 step 1: loss nan, iter time: 1957.89ms", 1),  # the optimizer step wins
        ("Epoch 3/10 - loss: 0.5", 3),  # nothing finer
        ("[12/100] loss: 0.5", 12),
        ("s:12 trl:9.79 lr:0.000011 norm:3.01", 12),  # llm.c
        ("Iter(train) [  50/20000]  lr: 1e-4  loss: 2.3", 50),  # mmengine
        ("INFO: 2epoch:train:12009-12640batch: iter_time=3e-4, loss=65.1", 12640),  # ESPnet
        ("420 | loss 4.0625 | lr 9.000000e-04 | 7367.57ms", 420),
        ("STEP 7 LOSS 2.0", 7),  # case-blind
        ("Steps : 210005, Gen Loss Total : 25.663, Mel-Spec. Error : 0.407", 210005),  # HiFi-GAN
        ("steps: 16 loss: 0.7332 iter time (s): 3.181 samples/sec: 0.314", 16),
        # a percentage is no step: the count of the bar is (kohya-ss sd-scripts)
        ("steps:   1%|▋     | 41/3280 [00:50<1:06:54,  1.24s/it, avr_loss=0.12]", 41),
        ("[2021-07-17 12:54:33] Ep. 1 : Up. 14000 : Sen. 965,843 : Cost 5.2 : Time 359.59s", 14000),
        ("epoch 0, total_step 24050, total loss is 47.09 , reg_loss is 0.08", 24050),
        ("| E104 iter[ 14/ 15] | [Loss] nan | [step]  1574 | [time] 0.4m", 1574),  # in brackets
    ],
)
def test_the_step(line: str, step: int) -> None:
    assert steps(line) == [step]


@pytest.mark.parametrize(
    ("text", "want"),
    [
        # a count within an epoch counts on from the epochs before (Keras: one line each)
        ("Epoch 1/10\n3/5 [====] - loss: 1.0\nEpoch 2/10\n3/5 [====] - loss: 0.9", [3, 8]),
        ("Epoch [2/10], Step [100/600], Loss: 0.2", [700]),  # first epoch: 1
        (
            "Epoch 0:  6%| | 1/18 [00:08<02:29, loss=10.4]\nEpoch 1:  6%| | 1/18 [00:08, loss=9]",
            [1, 19],
        ),
        ("Epoch  1, 12900/37527; acc:   4.48; xent:  10.47", [12900]),  # OpenNMT
        ("Epoch(train) [2][ 50/100]  lr: 1e-4  loss: 2.3", [150]),
        ("[pretrain.py][INFO] Epoch:[0/2](7000/293491) loss:nan lr:0.00009", [7000]),  # baby-llama2
        # Swin-style loggers name no epoch: "[epoch/E][count/N]"
        (
            "Train: [0/300][10/100]\tloss 2.0 (2.1)\nTrain: [1/300][10/100]\tloss 1.9 (2.0)",
            [10, 110],
        ),
        # a count that ran on when the epoch (on a line of its own) changed counts the run
        (
            "epoch 1/80\nsteps:   1%| | 41/3280 [00:50, avr_loss=0.5]\n"
            "epoch 2/80\nsteps:   2%| | 82/3280 [01:40, avr_loss=0.4]\n"
            "epoch 3/80\nsteps:   4%| | 123/3280 [02:28, avr_loss=0.3]",
            [41, 82, 123],
        ),
    ],
)
def test_counts_within_epochs(text: str, want: list[int]) -> None:
    assert steps(text) == want


@pytest.mark.parametrize(
    "line",
    [
        "[2018-11-26 15:06:01,481 INFO] loss: 2.5",  # a timestamp is no step
        "[02/10 22:55:41 d2.engine.train_loop]: loss: 2.5",  # nor a date
        "2023/06/09 21:58:41 - mmengine - INFO - loss: 2.5",
        "global_step/sec: 2.1 loss: 2.5",  # a rate is no step
        "number of skipped iterations:   0 | loss: 2.5",
        "steps/sec: 2.1 loss: 2.5",
        "Total optimization steps = 1000 | loss: 2.5",  # "steps" counts only with a colon
    ],
)
def test_no_step_where_none_is_printed(line: str) -> None:
    assert steps(line) == [1]  # the record's position


@pytest.mark.parametrize(
    ("line", "values"),
    [
        ("step 1 loss: 2.5", {"loss": 2.5}),
        ("step 1 loss=2.5", {"loss": 2.5}),
        ("step 1 loss 2.5", {"loss": 2.5}),
        (
            "| epoch 1 | loss 6.343 | gnorm 0.390 | loss_scale 0.500 |",
            {"loss": 6.343, "grad_norm": 0.39, "loss_scale": 0.5},
        ),
        ("step 1; acc: 0.19; xent: nan;", {"acc": 0.19, "loss": math.nan}),
        (
            "{'loss': 0.58, 'grad_norm': 1.3, 'learning_rate': 5e-4, 'epoch': 0.17}     ",
            {"loss": 0.58, "grad_norm": 1.3, "lr": 5e-4},
        ),
        ('{"loss": 1e-3, "step": 4}', {"loss": 1e-3}),
        (
            "1/9 [==>...] - ETA: 8:29 - loss: 0.6912 - accuracy: 0.5938",
            {"loss": 0.6912, "accuracy": 0.5938},
        ),
        (
            "step 1 loss=inf grad_norm=-inf lr=NaN",
            {"loss": math.inf, "grad_norm": -math.inf, "lr": math.nan},
        ),
        ("step 1 loss: tensor(2.5, device='cuda:0', grad_fn=<Nll>)", {"loss": 2.5}),
        ("step 1 loss 2.5 mfu 16.68% line 132 time 12ms", {"loss": 2.5}),  # unknown + blank: no
        ("step:10/1000 train_loss:nan train_time:1ms step_avg:nanms", {"loss": math.nan}),
        (
            "step 3 Train loss nan, Learning Rate 1.000e-05, It/sec 0.5",
            {"loss": math.nan, "lr": 1e-5},
        ),
        (
            "step 3 lm loss: 3.1 | loss scale: 65536.0 | grad norm: 12952.562",
            {"loss": 3.1, "loss_scale": 65536.0, "grad_norm": 12952.562},
        ),
        (
            "step 3 loss_total=1.5 total_norm=2.0 scale=8",
            {"loss": 1.5, "grad_norm": 2.0, "loss_scale": 8.0},
        ),
        ("step 3 Loss：1.98", {"loss": 1.98}),  # a full-width colon
        (  # BigDL: sentences; the word before "Loss" ends one and qualifies nothing
            "[Iteration 45459] Throughput is 447.2 records/second. Loss is Infinity. Current "
            "learning rate is 0.0462.",
            {"loss": math.inf, "lr": 0.0462},
        ),
        ("step 3 box_loss=0.25 cls_loss=0.5 dfl_loss=1.0", {"loss": 1.75}),  # parts: YOLO's
        ("step 3 | [Loss] nan | [exp] ./exp/0125 |", {"loss": math.nan}),  # a name in brackets
        ("Ep. 7 : Up. 306350 : Sen. 5630845 : Cost 34.46 : Time 6.91s", {"loss": 34.46}),
        ("step 3, total loss is 47.09 , reg_loss is 0.08", {"loss": 47.09, "reg_loss": 0.08}),
    ],
)
def test_the_metrics(line: str, values: dict[str, float]) -> None:
    (record,) = records(line)
    got = {key: record.values[key] for key in values}
    assert str(got) == str(values)  # (a NaN is equal to nothing; its text is "nan")


@pytest.mark.parametrize(
    "name",
    ["xent", "nll_loss", "lm loss", "total_loss", "train_loss", "Train loss", "loss_total", "trl",
     "train/loss", "train/loss_step", "loss train", "avg_loss", "average_loss", "mean_loss",
     "running_loss", "batch_loss", "step_loss", "avr_loss", "Loss Total", "Cost"],
)  # fmt: skip
def test_loss_aliases(name: str) -> None:
    assert key_of(name) == "loss"


@pytest.mark.parametrize(
    ("name", "key"),
    [
        *[
            (name, "grad_norm")
            for name in ("gnorm", "grad norm", "grad_norm", "total_norm", "norm")
        ],
        *[(name, "loss_scale") for name in ("loss scale", "loss_scale", "scale")],
        *[(name, "lr") for name in ("lr", "learning rate", "Learning Rate", "learning_rate")],
        *[
            (name, "val_loss")
            for name in ("val_loss", "val loss", "eval_loss", "Val loss", "tel", "evaluation_loss")
        ],
        ("params norm", "params_norm"),  # a word in front makes another quantity
        ("aux loss", "aux_loss"),
        ("loss_cls", "loss_cls"),
        ("records/second. Loss", "loss"),  # a word that ends a sentence qualifies nothing
        ("model.layers.0 norm", "model.layers.0_norm"),  # a dotted name does
        ("step", None),
        ("Steps", None),
        ("epoch", None),
        ("total_step", None),
        ("Up.", None),
        ("reg_loss is", "reg_loss"),  # "is" names nothing: the word before it does
    ],
)
def test_other_aliases(name: str, key: str | None) -> None:
    assert key_of(name) == key


def test_the_readme_shows_the_whole_alias_table() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## What `diagnose` reads", 1)[1].split("\n## ", 1)[0]
    rows = {
        line.split("|")[1].strip().split()[0].strip("`"): line.split("|")[2]
        for line in section.splitlines()
        if line.startswith("| `")
    }
    for name, key in ALIASES.items():
        assert f"`{name}`" in rows[key], name


def test_the_alias_table_is_lower_case() -> None:
    assert all(name == name.lower() for name in ALIASES)


def test_validation_loss_is_not_the_training_loss() -> None:
    (record,) = records("Iter 200: Val loss 1.234, Val took 5.2s")
    assert record.values == {"val_loss": 1.234}
    (record,) = records("step 5 - loss: 0.5 - val_loss: 0.7 - eval_loss: 0.8")
    assert record.values == {"loss": 0.5, "val_loss": 0.7}


def test_loss_parts_add_up_to_a_missing_loss() -> None:
    text = (
        "FloatingPointError: Loss became infinite or NaN at iteration=27!\n"
        "loss_dict = {'loss_cls': tensor(1.5, device='cuda:0'), 'loss_box_reg': tensor(0.25)}\n"
    )
    (record,) = records(text)
    assert (record.step, record.values["loss"]) == (27, 1.75)
    (record,) = records("iter: 19  total_loss: 1.750  loss_cls: 1.248  loss_box_reg: 0.503")
    assert record.values["loss"] == 1.750


DS = "[deepspeed] OVERFLOW! Rank 0 Skipping step."


def test_tables_read_by_column() -> None:
    """A header of names (a counter first, a loss among them) and rows of values below it."""
    yolo = (
        "      Epoch    GPU_mem   box_loss   cls_loss   dfl_loss  Instances       Size\n"
        "      22/55      9.02G     0.1157      5.355      2.998         17        640: 100%|###| "
        "954/954 [11:33<00:00,  1.38it/s]\n"
        "                 Class     Images  Instances      Box(P          R      mAP50  mAP50-95): "
        "100%|###| 66/66 [00:37<00:00,  1.74it/s]\n"
        "                   all       1049       1164      0.455      0.827      0.458       0.35\n"
    )
    (record,) = records(yolo)
    assert record.step == 22  # epoch 22 of 55: a table that counts epochs is read in epochs
    assert record.values["box_loss"] == 0.1157 and record.values["Instances"] == 17
    assert math.isclose(record.values["loss"], 0.1157 + 5.355 + 2.998)  # the parts add up
    assert "GPU_mem" not in record.values  # "9.02G" is no number
    fastai = (
        "epoch  train_loss  valid_loss  accuracy  time\n"
        "0  1.25  0.98  0.61  00:12\n"
        "1  nan  nan  0.10  00:12"
    )
    got = [(r.step, r.values) for r in records(fastai)]
    assert str(got) == str(
        [(0, {"loss": 1.25, "val_loss": 0.98, "accuracy": 0.61}),
         (1, {"loss": math.nan, "val_loss": math.nan, "accuracy": 0.1})]
    )  # fmt: skip


def test_yolo_legacy_tables_name_their_losses_box_obj_cls() -> None:
    """YOLOv3/v5/v7 before v6: ``box obj cls`` (and ``total``, their sum) are the losses."""
    text = (
        "     Epoch   gpu_mem       box       obj       cls     total    labels  img_size\n"
        "    42/299     65.1G       nan    0.0151         0       nan      1963       320: 100%|"
        "####| 729/729 [51:09<00:00,  4.21s/it]\n"
        " Epoch   gpu_mem       box       obj       cls    labels  img_size\n"
        "      1/99     2.64G      0.05      0.02      0.01         4       416: 100%|##| 7/7 [\n"
    )
    first, second = records(text)
    assert first.step == 42 and math.isnan(first.values["loss"])  # total: the loss
    assert first.values["obj_loss"] == 0.0151 and first.values["labels"] == 1963
    assert second.step == 1 + 0 and math.isclose(second.values["loss"], 0.08)  # the parts add up
    (none,) = records("Epoch  box  obj  cls\n1 2 3 4\nstep 9 loss 1.0\n")[-1:]  # no loss named:
    assert none.step == 9  # four cells but a counter and the parts only: still read as a table


def test_key_value_tables_between_rulers_are_one_record_each() -> None:
    """OpenAI's logger dumps ``| name | value |`` rows between rulers of dashes: one record, the
    step one of the rows (``1.53e+05``); guided diffusion's ``Found NaN, decreased lg_loss_scale
    to X`` lines are skipped steps at scale 2^X."""
    text = (
        "-----------------------------\n"
        "| grad_norm     | 0.348     |\n"
        "| loss          | 0.384     |\n"
        "| samples       | 3.3e+05   |\n"
        "| step          | 3.3e+03   |\n"
        "-----------------------------\n"
        "-----------------------------\n"
        "| loss          | nan       |\n"
        "| step          | 1.53e+05  |\n"
        "-----------------------------\n"
        "Found NaN, decreased lg_loss_scale to -3.5\n"
        "Found NaN, decreased lg_loss_scale to -4.5\n"
    )
    first, second, *skips = records(text)
    assert first == StepRecord(3300, {"grad_norm": 0.348, "loss": 0.384, "samples": 3.3e5})
    assert second.step == 153000 and math.isnan(second.values["loss"])
    assert [(r.step, r.values["skipped"], r.values["loss_scale"]) for r in skips] == [
        (153001, 1.0, 2**-3.5),
        (153002, 1.0, 2**-4.5),  # a new scale: a new skip, not the last one printed again
    ]
    lines = [line for _, line in numbered_blocks(text.splitlines())]
    assert len(lines) == len(text.splitlines()) and lines[1].startswith("step: 3300, grad_norm=")


def test_a_step_line_then_indented_name_value_lines_make_one_record() -> None:
    """OLMo (allenai/OLMo#692): the step on a line of its own after a timestamp and the logger's
    name, the metrics below it a line each, indented, thousands separated (``195,153``);
    ``CrossEntropyLoss`` is the loss, ``optim/total_grad_norm`` the gradient norm."""
    text = (
        "    System/Peak GPU Memory (MB)=6,784\n"
        "2024-08-06 09:59:26.181 intern-studio-160750:0  olmo.train:908  INFO    "
        "[step=1/739328,epoch=0]\n"
        "    optim/total_grad_norm=231.7\n"
        "    train/CrossEntropyLoss=12.18\n"
        "    train/Perplexity=195,153\n"
        "    throughput/total_tokens=1,048,576\n"
        "2024-08-06 10:00:05.520 intern-studio-160750:0  olmo.train:908  INFO    "
        "[step=2/739328,epoch=0]\n"
        "    optim/total_grad_norm=0.0002\n"
        "    train/CrossEntropyLoss=1.7872662283480167e-06\n"
    )
    first, second = records(text)
    assert first == StepRecord(
        1,
        {"grad_norm": 231.7, "loss": 12.18, "ppl": 195153.0, "throughput/total_tokens": 1048576.0},
    )
    assert second == StepRecord(2, {"grad_norm": 0.0002, "loss": 1.7872662283480167e-06})


def test_thousands_separators_camel_case_losses_and_perplexity() -> None:
    """``Sen. 1,052,108`` (Marian) is one number; ``CTCLoss`` a loss, ``ValLoss`` none; a
    perplexity alone gives the loss as its log (data2text#9: ``PPL 8226.52``)."""
    (marian,) = records("Ep. 1 : Up. 16000 : Sen. 1,052,108 : Cost 6.59608603 : Time 1153.11s")
    assert marian.values["Sen."] == 1052108
    (ctc,) = records("step 3 CTCLoss: 1.5 ValLoss: 2.5")
    assert ctc.values == {"loss": 1.5, "val_loss": 2.5}
    (ppl,) = records("Epoch 1 ; Iter 50/213 ; LR 1.0000 ; Target tokens/s 1265 ; PPL 8226.52 ;")
    assert math.isclose(ppl.values["loss"], math.log(8226.52)) and ppl.step == 50
    (nan,) = records("step 4 PPL nan")
    assert math.isnan(nan.values["loss"])
    (both,) = records("step 5 loss 2.0 ppl 7.39")
    assert both.values["loss"] == 2.0  # a printed loss wins


def test_a_table_counter_named_steps() -> None:
    """A table whose counter column is ``Steps`` (D3Feat): its rows are at those steps."""
    text = "Steps desc_loss det_loss train_accuracy time\n9753 nan 0.5 0.00 1698.001\n"
    (record,) = records(text)
    assert (record.step, record.values["det_loss"], math.isnan(record.values["loss"])) == (
        9753,
        0.5,
        True,
    )


def test_tables_under_a_ruler_of_dashes() -> None:
    """A header over a ruler of dashes, a column a run: names of two words, ``E`` the epoch and
    ``#`` the step (spaCy), the ``LOSS ...`` columns the loss's parts."""
    text = (
        "E    #       LOSS TOK2VEC  LOSS NER  ENTS_F  SCORE \n"
        "---  ------  ------------  --------  ------  ------\n"
        "  0       0          0.00     40.00    9.57    0.10\n"
        "  1     200         35.70   2163.45   83.16    0.83\n"
    )
    got = [(r.step, r.values) for r in records(text)]
    assert got[1] == (
        200,
        {"loss_tok2vec": 35.7, "loss_ner": 2163.45, "ents_f": 83.16, "score": 0.83,
         "loss": 35.7 + 2163.45},
    )  # fmt: skip
    assert [step for step, _ in got] == [0, 200]
    no_counter = "A    B    loss\n---  ---  ----\n1    2    3\n"
    assert not any("B" in r.values or "b" in r.values for r in records(no_counter))


@pytest.mark.parametrize(
    "text",
    [
        "Epoch  gpu_mem  box  obj  cls\n1/99  2.6G  0.1  0.2  0.3",  # no loss named: no table
        "the loss is going down\n1 2 3 4 5",  # no counter first
        "epoch train_loss valid_loss\nsome words here 1.0\n0 1.25 0.98",  # a row must follow
    ],
)
def test_no_table_without_a_header_and_its_rows(text: str) -> None:
    assert not any("valid_loss" in r.values or "box" in r.values for r in records(text))


@pytest.mark.parametrize(
    ("line", "scale"),
    [
        (f"{DS} Attempted loss scale: 65536, reducing to 32768", 32768),
        (f"{DS} Attempted loss scale: 65536, but hysteresis is 2. Reducing hysteresis to 1", 65536),
        ("| WARNING: overflow detected, setting loss scale to: 0.0625", 0.0625),
        ("NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: 32.0", 32.0),
        ("Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 4096.0", 4096.0),
        ("Reducing dynamic loss scale from 8.0 to 4.0", 4.0),
        ("OVERFLOW! Skipping step. Attempted loss scale: 65536.0, reducing to 32768.0", 32768.0),
    ],
)  # fmt: skip
def test_overflow_lines_are_skipped_steps_with_the_new_scale(line: str, scale: float) -> None:
    (record,) = records(line)
    assert record.values == {"skipped": 1.0, "loss_scale": scale}


def test_one_overflow_printed_by_many_ranks_is_one_skipped_step() -> None:
    text = (
        "Grad overflow on iteration 3\n"
        "[INFO] [fused_optimizer.py:316:_update_scale] "
        "Reducing dynamic loss scale from 8.0 to 4.0\n"
        "Grad overflow on iteration 3\n"
        "Reducing dynamic loss scale from 8.0 to 4.0\n"
        "[Rank 0] Overflow detected. Skipping step. Attempted loss scale: 8.0, reducing to 4.0\n"
    )
    assert [r.values for r in records(text)] == [{"skipped": 1.0, "loss_scale": 4.0}]


def test_the_same_rank_reporting_again_is_another_overflow() -> None:
    line = "[deepscale] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 1, reducing to 1\n"
    bars = "".join(f"  0%|▋      | {n}/24128 [00:40<2:40:10,  2.50it/s]{line}" for n in (98, 99))
    assert len(records(line + bars)) == 3  # stuck at the floor, rank 0 reports each anew
    ranks = "".join(line.replace("Rank 0", f"Rank {rank}") for rank in range(3))
    assert len(records(ranks)) == 1  # one overflow, every rank says it
    assert len(records(line + line)) == 1  # one overflow, two loggers say it


def test_a_record_printed_over_several_lines_is_one_record() -> None:
    text = (
        "iteration 5/50 | elapsed time per iteration: 21392.5 ms |\n"
        "learning rate: 1.350000E-04 | global batch size: 4096 |\n"  # alone: a configuration
        "loss scale: 1.0 | grad norm: nan |\n"
    )
    (record,) = records(text)
    assert record.step == 5 and (record.values["lr"], record.values["loss_scale"]) == (1.35e-4, 1)
    assert math.isnan(record.values["grad_norm"])


def test_overflows_go_just_before_the_next_step() -> None:
    text = (
        "step 100 loss=2.0 loss_scale=4\n"
        "overflow detected, setting loss scale to: 2\n"
        "overflow detected, setting loss scale to: 1\n"
        "step 200 loss=2.0 loss_scale=1\n"
    )
    assert steps(text) == [100, 198, 199, 200]


def test_records_without_a_step_take_their_position() -> None:
    text = "{'loss': 1.0}\n{'loss': 1.1}\n...\n{'loss': 1.2}\n"
    assert [(r.step, r.values["loss"]) for r in records(text)] == [(1, 1.0), (2, 1.1), (3, 1.2)]


def test_a_metric_line_without_a_step_goes_before_the_next_step() -> None:
    text = "WARNING: The grad norm is nan. Skipping updating the model.\n" * 2 + (
        "INFO: 2epoch:train:12009-12640batch: loss=65.129\n"
    )
    got = records(text)
    assert [r.step for r in got] == [12638, 12639, 12640]
    assert all(math.isnan(r.values["grad_norm"]) for r in got[:2])


def test_a_configuration_line_with_a_learning_rate_is_no_record() -> None:
    text = (
        "INFO [train] config: batch_size=32 lr=3e-4 warmup=100\n"
        "INFO [train] step=0 loss=6.2604 grad_norm=0.6693 lr=3.0e-04\n"
    )
    assert records(text) == [StepRecord(0, {"loss": 6.2604, "grad_norm": 0.6693, "lr": 3e-4})]


def test_tqdm_redraws_joined_by_carriage_returns() -> None:
    bar = "Epoch 0:  {p}%|█| {n}/18 [00:0{n}<00:53, 4.14s/it, loss={loss}, v_num=1]"
    text = "\r".join(
        bar.format(p=p, n=n, loss=loss)
        for p, n, loss in [(6, 1, 10.5), (6, 1, 10.473), (11, 2, 10.473), (11, 2, 10.2)]
    )
    assert [(r.step, r.values["loss"]) for r in records(text + "\n")] == [(1, 10.473), (2, 10.2)]


def test_a_record_printed_twice_is_one_record() -> None:
    text = (
        "step 10 loss 2.5 lr 0.1\n"
        "2024-01-01 10:00:00 INFO step 10 loss 2.5 lr 0.1\n"
        "{'loss': 1.5, 'grad_norm': 0.5}\n"
        "{'loss': 1.5, 'grad_norm': 0.5}\n"
    )
    assert [(r.step, r.values["loss"]) for r in records(text)] == [(10, 2.5), (11, 1.5)]


def test_lines_wrapped_by_a_terminal_make_one_record() -> None:
    text = (
        "[default7]: iteration   42780/ 115311 | consumed samples:    71455664 | learning\n"
        " rate: 4.475E-05 | global batch size: 2048 | lm loss: 2.117073E+00 | grad norm: 0.15 |\n"
        "num zeros: 0.0 |\n"
    )
    (record,) = records(text)
    assert record.step == 42780
    assert {k: record.values[k] for k in ("lr", "loss", "grad_norm")} == {
        "lr": 4.475e-05,
        "loss": 2.117073,
        "grad_norm": 0.15,
    }


def test_log_entries_are_not_wrapped_lines() -> None:
    text = "step 5 loss=2.0\n2024-01-01 10:00:00 WARNING grad_norm: nan\nstep 6 loss=2.0\n"
    assert [(r.step, sorted(r.values)) for r in records(text)] == [
        (5, ["loss"]),
        (6, ["grad_norm"]),  # just before step 6, not merged into step 5
        (6, ["loss"]),
    ]


def test_survives_tracebacks_cut_lines_ansi_and_rank_prefixes() -> None:
    text = (
        "\x1b[32m[default0]: step 1 loss 2.0\x1b[0m\n"
        "...\n"
        "Traceback (most recent call last):\n"
        '  File "train.py", line 132, in train\n'
        "    self.run_step()\n"
        "RuntimeError: CUDA error: device-side assert triggered\n"
        "[default0]: step 2 loss nan\n"
    )
    assert [(r.step, str(r.values["loss"])) for r in records(text)] == [(1, "2.0"), (2, "nan")]


def test_a_value_printed_as_a_one_element_array_after_a_colon() -> None:
    text = "Total iter: 0, epoch: 0, batch: 0, loss: [10.000229]\niter=10 loss=[nan] lr=[1e-06]\n"
    got = [(r.step, r.values) for r in records(text)]
    assert got[0] == (0, {"loss": 10.000229})
    assert got[1][0] == 10 and math.isnan(got[1][1]["loss"]) and got[1][1]["lr"] == 1e-06
    # a bracket after a blank is no value: "Epoch [1][100/200]" prints no epoch metric
    assert "epoch" not in records("Epoch [1][100/200]  loss: 0.5\n")[0].values


def test_a_value_in_markdown_bold() -> None:
    line = "GLOBAL STEP : 29003 / LEARNING RATE : 0.001 / **LOSS : nan** ( 1.92 secs)\n"
    (record,) = records(line)
    assert record.step == 29003 and record.values["lr"] == 0.001
    assert math.isnan(record.values["loss"])


def test_the_total_of_a_list_of_losses_is_the_loss() -> None:
    line = "[Epoch 0/30, Batch 323/1313] [Losses: x 0.1, y 0.2, conf 0.75, cls 0.3, total 1.35]\n"
    (record,) = records(line)
    assert (record.step, record.values["loss"]) == (323, 1.35)
    assert "loss" not in records("step 5 total 1313 acc 0.9\n")[0].values  # no losses named


def test_restart_when_the_step_goes_back() -> None:
    got = items("step 10 loss 1\nstep 20 loss 1\nstep 15 loss 1\nstep 25 loss 1\n")
    assert got[2] == Restart(15, 3, "step went back from 20 to 15")
    assert [item.step for item in got] == [10, 20, 15, 15, 25]


def test_restart_after_a_resume_banner() -> None:
    got = items("iter 10: loss 1.0\nResuming training from out\niter 20: loss 1.0\n")
    assert got[1] == Restart(20, 3, "resume banner 'Resuming training from out'")


def test_no_restart_before_the_first_record() -> None:
    got = items("EPOCH0\nResuming training from out\n iteration 10/ 100 | lm loss: 3.0E+00 |\n")
    assert got == [StepRecord(10, {"loss": 3.0})]


def test_read_from_bytes_yields_restarts() -> None:
    notes: list[Note] = []
    data = b"step 10 loss 1\nstep 5 loss 1\n"
    got = list(UniversalReader(notes).read(io.BytesIO(data)))
    assert got == [
        StepRecord(10, {"loss": 1.0}),
        Restart(5, 2, "step went back from 10 to 5"),
        StepRecord(5, {"loss": 1.0}),
    ]
    assert not notes


@pytest.mark.parametrize(
    ("head", "low", "high"),
    [
        (["step 1 loss 2.0", "step 2 loss 1.9"], 0.3, 0.85),  # read well, below dedicated ~0.9
        (["{'loss': 2.0}"], 0.3, 0.85),
        (["Saving checkpoint at step 100"], 0.1001, 0.3),  # a step: above the 0.1 threshold
        (["Training complete", "bye"], 0.0, 0.0),
    ],
)
def test_sniff(head: list[str], low: float, high: float) -> None:
    assert low <= UniversalReader.sniff(head) <= high


def test_unreadable_message_names_the_flag_and_the_first_likely_line() -> None:
    lines = ["Loading model", "tokens per iteration will be: 491,520", "epoch 1 done", "bye"]
    message = unreadable_message("run.log", lines)
    assert message.startswith("run.log: no training steps found; looked for lines with a step")
    assert "--format" in message and "format=" not in message
    assert "line 3 looked like one but was not read: 'epoch 1 done'" in message
    assert "looked like one" not in unreadable_message("x.log", ["hello", "world"])


SEEDS = [
    "step 1 loss 2.0",
    "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 4, reducing to 2",
    "{'loss': nan, 'grad_norm': tensor(1.0)}",
    "Epoch 3/10",
    "1/9 [===] - loss: 0.5",
    "Resuming training from out",
    "iter 8 step 1: loss nan",
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.sampled_from(SEEDS), st.text(max_size=60)), max_size=25))
def test_any_lines_give_int_steps_and_float_values(lines: list[str]) -> None:
    for item in UniversalReader().read_lines(lines):
        if isinstance(item, StepRecord):
            assert isinstance(item.step, int) and item.values
            assert all(isinstance(value, float) for value in item.values.values())


def test_per_rank_memory_and_timer_lines_are_no_records() -> None:
    """Megatron's ``after 100 iterations memory (MB) | allocated: ...`` and ``time (ms) |
    forward: ...`` lines (megatron_lm_issue5_2019_no_colon_healthy), also with a rank: no step
    of their own ("iterations" is no counter), no signal: no records between the iterations."""
    text = (
        " iteration      100/   20000 | learning rate 1.010E-06 | lm loss 1.020020E+01 |\n"
        "after 100 iterations memory (MB) | allocated: 5133.326171875 | max allocated: 7899.06\n"
        "[Rank 1] (after 100 iterations) memory (MB) | allocated: 5133.3 | reserved: 9324.0\n"
        "time (ms) | forward: 132.49 | backward: 182.57 | optimizer: 18.18\n"
        " iteration      200/   20000 | learning rate 2.020E-06 | lm loss 9.444483E+00 |\n"
    )
    assert [(r.step, r.values) for r in records(text)] == [
        (100, {"lr": 1.01e-06, "loss": 10.2002}),
        (200, {"lr": 2.02e-06, "loss": 9.444483}),
    ]


def test_a_bracketed_epoch_then_a_count_is_the_step() -> None:
    """``[  3]    2210 || B: ...``: the epoch in brackets, then the count: the count is the step."""
    text = "[  3]    2210 || B: 0.512 | loss: 2.31\n[  4]    2220 || B: 0.498 | loss: 2.29\n"
    assert steps(text) == [2210, 2220]


def test_a_signals_nan_with_trailing_junk_is_a_nan_a_timers_is_no_value() -> None:
    (record,) = records("step 7 loss: nanxxx grad_norm: 1.5 step_avg:nanms")
    assert math.isnan(record.values["loss"]) and record.values["grad_norm"] == 1.5
    assert "step_avg" not in record.values


@pytest.mark.parametrize(
    ("line", "vocab"),
    [
        ("{'model_name': 'pythia-70m', 'vocab_size': 50254, 'padded_vocab_size': 50304}", 50304),
        ("found vocab_size = 65 (inside data/shakespeare_char/meta.pkl)", 65),  # nanoGPT
        ("Vocabulary size: 32000", 32000),
        ("vocab is 1000 words", 1000),
    ],
)
def test_a_stated_vocabulary_rides_on_the_next_record(line: str, vocab: int) -> None:
    """Chance level is ln of the vocabulary: the first record after a line that states it
    carries it (``vocab_size``), once."""
    first, second = records(f"{line}\niter 1: loss 4.17\niter 2: loss 4.16\n")
    assert first.values["vocab_size"] == vocab
    assert "vocab_size" not in second.values


def test_no_vocabulary_without_its_number() -> None:
    text = "defaulting to vocab_size of GPT-2 to 50304\niter 1: loss 4.17\n"
    assert "vocab_size" not in records(text)[0].values


def test_a_line_that_names_only_its_epoch_goes_with_the_counted_records() -> None:
    """fairseq's ``| epoch 003 | valid on 'valid' subset | valid_loss ...`` after a summary at
    ``num_updates 1101``: no step 3 (no restart); it joins the record above it."""
    text = (
        "| epoch 001 | loss 8.7 | num_updates 367 | loss_scale 256\n"
        "| epoch 001 | valid on 'valid' subset | valid_loss 8.2 | valid_nll_loss 6.9\n"
        "| epoch 002 | loss 8.4 | num_updates 734 | loss_scale 128\n"
        "| epoch 002 | valid on 'valid' subset | valid_loss 7.9 | valid_nll_loss 6.8\n"
    )
    found = items(text)
    assert not any(isinstance(item, Restart) for item in found)
    assert [(r.step, r.values["loss"], r.values["val_loss"]) for r in records(text)] == [
        (367, 8.7, 8.2),
        (734, 8.4, 7.9),
    ]


def test_an_epoch_log_that_goes_back_still_restarts() -> None:
    text = "Epoch 5: loss 2.1\nEpoch 6: loss 2.0\nEpoch 3: loss 2.4\nEpoch 4: loss 2.3\n"
    assert [item.step for item in items(text) if isinstance(item, Restart)] == [3]


def test_held_out_parts_are_no_training_loss() -> None:
    """A validation line's ``valid_nll_loss`` or ``val/box_loss`` is no part of the loss."""
    [record] = records("step 5 val_loss 2.2 valid_nll_loss 1.9 val/box_loss 0.3\n")
    assert "loss" not in record.values
    [parts] = records("step 5 box_loss 0.3 cls_loss 0.2 val/box_loss 0.4\n")
    assert parts.values["loss"] == 0.5


def test_albef_json_lines_numbers_as_strings_loss_parts_behind_a_training_prefix() -> None:
    """ALBEF, BLIP and TCL log ``{"train_" + name: "{:.3f}".format(meter)}`` a line per epoch
    (TCL#18: unread before, "no training steps found"): the ``train_loss_*`` parts are the
    parts of the loss, their sum its loss, the epoch the step."""
    text = (
        '{"train_lr": "0.000", "train_loss_mlm": "2.017", "train_loss_ita": "2.352", '
        '"train_loss_itm": "0.451", "epoch": 0}\n'
        '{"train_lr": "0.000", "train_loss_mlm": "1.364", "train_loss_ita": "2.032", '
        '"train_loss_itm": "0.347", "epoch": 1}\n'
    )
    first, second = records(text)
    assert (first.step, second.step) == (0, 1)
    assert first.values["loss"] == pytest.approx(2.017 + 2.352 + 0.451)
    assert first.values["train_loss_itm"] == 0.451


def test_a_counter_keyed_with_its_total_and_a_quoted_value_is_the_step() -> None:
    """ms-swift's JSON lines count their step only as ``"global_step/max_steps": "8280/11043"``
    (ms-swift#2436: the NaN gradient norm had been placed at record 3)."""
    line = (
        '{{"loss": 1.4, "grad_norm": {norm}, "epoch": 0.75, "global_step/max_steps": '
        '"{step}/11043", "train_speed(iter/s)": 0.4}}\n'
    )
    text = line.format(norm="3.48", step=8270) + line.format(norm="NaN", step=8280)
    found = records(text)
    assert [r.step for r in found] == [8270, 8280]
    assert math.isnan(found[1].values["grad_norm"])


def test_an_array_of_per_device_losses_gives_its_first() -> None:
    """Paddle prints one loss a device, ``loss [     nan 9.211133 ...]`` (Paddle#11659: the
    NaN was not read at all)."""
    text = (
        "Pass 0, batch 400, loss [9.351679 9.2102585 9.151485]\n"
        "Pass 0, batch 500, loss [     nan 9.211133      nan]\n"
    )
    found = records(text)
    assert [r.step for r in found] == [400, 500]
    assert found[0].values["loss"] == 9.351679 and math.isnan(found[1].values["loss"])


def test_a_loss_printed_after_its_iteration() -> None:
    """NVIDIA's Tacotron 2 and its forks print ``Train loss {iteration} {loss:.6f}`` and
    ``Validation loss {iteration}:  {loss:9f}``: the integer is the step, the number after it the
    loss (Mellotron#79: the NaN was placed at the bar's count, its loss read as 130950; apex#493:
    every validation loss read as its iteration)."""
    text = (
        "Train loss 130949 0.412345 Grad Norm 1.234567 2.11s/it\n"
        "Validation loss 130949:  0.501234\n"
        "Train loss 130950 nan Grad Norm nan 2.11s/it\n"
    )
    first, second = records(text)
    assert (first.step, second.step) == (130949, 130950)
    assert first.values["loss"] == 0.412345 and first.values["val_loss"] == 0.501234
    assert math.isnan(second.values["loss"]) and math.isnan(second.values["grad_norm"])


def test_one_record_logged_as_several_entries_of_one_moment() -> None:
    """Sockeye logs each checkpoint as log entries of one second: ``Checkpoint [88]
    Updates=440000 ...`` (the step: its plural counter), then ``Checkpoint [88]
    Train-perplexity=2.603048`` (a training value behind a hyphenated prefix): one record
    (sockeye#811 was unread). An entry of another second is a record of its own."""
    fit = "INFO:sockeye.training:fit] Checkpoint"
    text = (
        f"[2020-05-14:17:46:36:{fit} [88] Updates=440000 Epoch=16 Samples=280841176 "
        "Time-cost=2919.597 Updates/sec=1.713\n"
        f"[2020-05-14:17:46:36:{fit} [88] Train-perplexity=2.603048\n"
        f"[2020-05-14:18:35:12:{fit} [89] Updates=445000 Epoch=16 Samples=284032011 "
        "Time-cost=2916.204 Updates/sec=1.715\n"
        f"[2020-05-14:18:35:12:{fit} [89] Train-perplexity=2.601230\n"
    )
    first, second = records(text)
    assert (first.step, second.step) == (440000, 445000)
    assert first.values["ppl"] == 2.603048 and second.values["ppl"] == 2.60123
    assert math.isclose(first.values["loss"], math.log(2.603048))
    assert "Updates" not in first.values  # the step's counter is none of its values


def test_a_loss_named_in_capitals_and_a_count_in_parentheses() -> None:
    """An AutoML controller's ``Step 4000, Minibatch Loss= 1.0120, Current accuracy= 0.730``:
    a loss part in any case is one (it was ``Minibatch_Loss``, no loss: the jump to ln 10 that
    stayed went unseen); ST-GCN's ``Batch(100/1879) done. Loss: 5.9635`` counts in parentheses
    (the 17 lines were one record, at the epoch line's step)."""
    first, second = records(
        "Step 4000, Minibatch Loss= 1.0120, Current accuracy= 0.730\n"
        "Step 4100, Minibatch Loss= 0.9515, Current accuracy= 0.690\n"
    )
    assert (first.step, first.values["loss"], second.values["loss"]) == (4000, 1.012, 0.9515)
    text = "[ Wed Jun  6 16:01:01 2018 ] Training epoch: 1\n" + "".join(
        f"[ Wed Jun  6 16:02:39 2018 ] \tBatch({n}/1879) done. Loss: 5.9{n // 100}  lr:0.100000\n"
        for n in (0, 100, 200)
    )
    assert [(r.step, r.values["loss"]) for r in records(text)] == [
        (0, 5.9),
        (100, 5.91),
        (200, 5.92),
    ]


def test_a_bracketed_count_that_begins_a_line_of_values_is_its_step() -> None:
    """Dreamer prints a summary every 1000 environment steps, ``[5000] expl_amount 0.0 /
    model_grad_norm nan / ... / model_loss 5864.5``: its records were numbered 1, 2, 3 (the
    model's inf loss placed at "step 3" where the log says 7000)."""
    text = (
        "[5000] expl_amount 0.0 / model_grad_norm nan / model_loss 5864.5 / value_loss 6.4\n"
        "Train episode of length 1000 with return 13.9.\n"
        "[6000] expl_amount 0.3 / model_grad_norm 4468751873343488.0 / model_loss 152175.0\n"
    )
    assert [r.step for r in records(text)] == [5000, 6000]


def test_a_pasted_log_history_excerpt_is_one_record_an_object() -> None:
    """Entries of a ``trainer_state.json``'s ``log_history`` pasted without the file around them:
    ``{``, a member a line, ``"step": 1440`` after the loss, ``},``. Each object was no record
    with its step: the losses were numbered 1, 2, 3 by their order. An object that holds a
    nested one (a configuration) is no record."""
    entry = '    {{\n      "epoch": 4.59,\n      "loss": {},\n      "step": {}\n    }},\n'
    text = entry.format(11.3599, 1440) + entry.format(6.9149, 1441)
    text += '{\n  "lr": 0.1,\n  "optimizer": {\n    "betas": [0.9, 0.95]\n  }\n}\n'
    assert [(r.step, r.values["loss"]) for r in records(text)] == [(1440, 11.3599), (1441, 6.9149)]
