"""The universal reader reads structure, not formats: a key that names a counter is the step,
values printed as strings are values, bare columns and tensor prints are read by the shape their
lines repeat, and an evaluation's lines are a series of their own, never the training loss.
Each case is a real log's lines (the source in its test); on the unchanged code each was unread
or misread."""

from __future__ import annotations

import math

from reader_cases import parse_items

from stabilizer.core.records import StepRecord
from stabilizer.replay.readers.base import Item, Restart


def items(text: str) -> list[Item]:
    return parse_items("generic", text)


def records(text: str) -> list[StepRecord]:
    return [item for item in items(text) if isinstance(item, StepRecord)]


def test_a_dict_of_strings_counted_by_a_key_that_names_the_updates() -> None:
    """eric-mitchell/direct-preference-optimization: ``train stats after N examples: {...}``,
    floats printed as strings, the optimizer step in ``counters/updates`` (not the examples)."""
    line = (
        "★---> train stats after {n} examples: {{'rewards_train/chosen': 'nan', 'loss/train': "
        "'nan', 'examples_per_second': '5.4887', 'grad_norm': 'nan', 'counters/examples': {n}, "
        "'counters/updates': {u}}}"
    )
    text = "\n".join(line.format(n=160768 + 32 * k, u=5024 + k) for k in range(3))
    found = records(text)
    assert [r.step for r in found] == [5024, 5025, 5026]
    assert all(math.isnan(r.values["loss"]) and math.isnan(r.values["grad_norm"]) for r in found)
    assert "counters/updates" not in found[0].values


def test_a_metric_and_its_split_as_a_path() -> None:
    """torch's ``SummaryWriter`` tags (``Loss/train``, ``Loss/test``) printed as they are logged."""
    (record,) = records("step 5 Loss/train 2.31 Loss/test 2.45\n")
    assert record.values == {"loss": 2.31, "val_loss": 2.45}


def test_a_name_between_rules_of_dashes() -> None:
    """BHui97/PLeak#2: ``-----------loss------------:  tensor(nan, device='cuda:3', ...)``."""
    line = "-----------loss------------:  tensor({}, device='cuda:3', dtype=torch.float16)"
    found = records("\n".join(line.format(v) for v in ("nan", "nan", "0.1054", "nan")))
    assert len(found) == 4 and found[2].values["loss"] == 0.1054
    assert math.isnan(found[3].values["loss"])


def test_bare_columns_are_read_by_their_repeated_shape() -> None:
    """A step and a loss and nothing else on each line: the rising integer column is the step."""
    text = "76910 2.6512345\n76920 2.6481234\n76930 2.6496577\n76940 nan\n"
    found = records(text)
    assert [r.step for r in found] == [76910, 76920, 76930, 76940]
    assert found[2].values == {"loss": 2.6496577} and math.isnan(found[3].values["loss"])


def test_bare_columns_named_by_their_split() -> None:
    """karpathy/build-nanogpt's ``log.txt``: ``{step} train {loss}`` a step, ``{step} val
    {loss}`` and ``{step} hella {acc}`` now and then (unread on dde525e): the word names the
    series; a word that names no split (YOLO's ``all``, ``hella``) makes no series of its own."""
    text = "0 val 10.9310\n0 hella 0.2413\n" + "".join(
        f"{step} train {loss}\n"
        for step, loss in enumerate((10.934416, 10.883945, 10.789145, 10.65))
    )
    text += "".join(f"{step} hella 0.24{step}\n" for step in (4, 5, 6))
    found = records(text)
    assert [(r.step, r.values) for r in found] == [
        (0, {"loss": 10.934416}),
        (1, {"loss": 10.883945}),
        (2, {"loss": 10.789145}),
        (3, {"loss": 10.65}),
    ]


def test_a_scalar_tensor_printed_as_it_is_is_read_as_the_loss() -> None:
    text = "".join(f"tensor({v}, device='cuda:0')\n" for v in (3.2207, 3.1907, 3.1511, 3.0702))
    found = records(text)
    assert [r.values["loss"] for r in found] == [3.2207, 3.1907, 3.1511, 3.0702]


def test_a_table_of_words_and_numbers_is_no_bare_series() -> None:
    """YOLOv5's validation rows repeat their shape, but their words say what they are: no loss."""
    text = "".join(
        f"                 all        128        929      0.7{k}      0.568      0.643\n"
        for k in range(4)
    )
    assert records(text) == []


def test_lines_of_a_loss_part_alone_are_records() -> None:
    """RuijieZhu94/ObjectGS#28: ``losses: {'image_loss': tensor(0.3150, ...)} [20/12 08:49:27]``."""
    line = "losses: {{'image_loss': tensor({}, device='cuda:0', grad_fn=<AddBackward0>)}} [20/12 "
    text = "\n".join(line.format(v) + "08:49:27]" for v in (0.3150, 0.2213, 0.2059))
    assert [r.values["loss"] for r in records(text)] == [0.3150, 0.2213, 0.2059]


def test_an_evaluation_loop_is_no_training_loss() -> None:
    """facebookresearch/fairseq#301: the validation loop prints its own progress line with a
    ``loss=`` among the training lines; it is a held-out loss on the current step, and its
    count (1000 of 1311 batches) is no training step (no restart)."""
    text = (
        "| epoch 010  8000 / 8223 loss=1.33 (1.45), wps=961, wpb=905, bsz=32, lr=0.001, clip=100%\n"
        "| epoch 010 | valid on 'valid' subset  1000 / 1311 loss=1.60\n"
        "| epoch 011  1000 / 8223 loss=1.89 (1.38), wps=963, wpb=918, bsz=32, lr=0.001, clip=100%\n"
    )
    found = items(text)
    assert not any(isinstance(item, Restart) for item in found)
    read = [r for r in found if isinstance(r, StepRecord)]
    assert [r.values["loss"] for r in read] == [1.33, 1.89]
    assert read[0].values["val_loss"] == 1.60


def test_a_test_set_loss_after_cjk_text_is_held_out() -> None:
    """xiaotudui/pytorch-tutorial#1: ``整体测试集上的Loss: 262.62`` (the whole test set's loss)
    after the training counts: not a training loss of 262."""
    text = (
        "训练次数：600, Loss：2.496931314468384\n"
        "训练次数：700, Loss：1.6171432733535767\n"
        "整体测试集上的Loss: 262.62046909332275\n"
        "训练次数：800, Loss：1.2562278509140015\n"
    )
    found = records(text)
    assert [r.values["loss"] for r in found] == [2.496931314468384, 1.6171432733535767,
                                                 1.2562278509140015]  # fmt: skip
    assert found[1].values["val_loss"] == 262.62046909332275


def test_fields_that_print_their_value_before_their_name() -> None:
    """tinygrad/tinygrad#13803 (examples/mlperf/model_train.py): ``   3 7.34 s run, 11.8750 loss,
    0.000000000002 LR, 1454.57 GB used`` (unread on the unchanged code)."""
    text = (
        "    1 93.44 s run, 11.8750 loss, 0.000000000001 LR, 642.43 GB used,  19644.30 GFLOPS\n"
        "    2 101.78 s run, 11.9375 loss, 0.000000000001 LR, 1454.57 GB used,  17039.35 GFLOPS\n"
    )
    found = records(text)
    assert [(r.values["loss"], r.values["lr"]) for r in found] == [
        (11.875, 1e-12),
        (11.9375, 1e-12),
    ]
