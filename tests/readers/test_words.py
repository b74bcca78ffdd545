"""The trainers' own words (`words.WORDS`): every row reads its message as printed, a message
that states a value gives its record that value, one that reports trouble comes out as a
finding that the trainer said it, and the lines of one event make one record."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from reader_cases import parse_items

from stabilizer.core.kinds import TRAINER_SAID
from stabilizer.core.records import Finding, Severity, StepRecord
from stabilizer.replay.readers.base import Item
from stabilizer.replay.readers.words import TRIGGERS, WORDS, Heard, heard_early, heard_in

# Messages as the trainers' sources print them: every row of the catalogue reads one of them.
EXAMPLES = [
    "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 64, reducing to 32",
    "NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: 32.0",
    "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 512.0",
    "Overflow on rank 0, reducing dynamic loss scale from 4096 to 2048",
    "Found NaN, decreased lg_loss_scale to 19.0",
    "[2023-11-28 14:31:29,583] [ WARNING] - optimizer not run, scale_before: 0.25, scale_after: "
    "0.125",
    "Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting "
    "run.",
    "FloatingPointError: Minimum loss scale reached (0.0001). Your loss is probably exploding. "
    "Try lowering the learning rate, using gradient clipping or increasing the batch size.",
    "ERROR:tensorflow:Model diverged with loss = NaN.",
    "2024-01-14 01:03:00,826 WARNING [train.py:1057] (2/4) Grad scale is small: "
    "1.2924697071141057e-26",
    "RuntimeError: grad_scale is too small, exiting: 8.470329472543003e-22",
    "tensorflow.python.training.basic_session_run_hooks.NanLossDuringTrainingError: NaN loss "
    "during training.",
    "Batch 3: Invalid loss, terminating training",
    "RuntimeError: Train loss contains a NaN.",
    "RuntimeError: nan loss encountered at step 1204",
    "loss become infinite or NaN!",
    "RuntimeError: Loss is diverging!",
    "ValueError: Loss is not finite and patience is exhausted. To debug, wrap `fit()` with "
    "autograd's `detect_anomaly()`, e.g.",
    "Unexpected result tensor(nan, device='cuda:0') on rank 3 at iteration #1200 invocation #1 "
    "(message='loss is NaN')",
    "Rank 0, node n1, device 0, iteration 1201: Unexpected result tensor(13.2, device='cuda:0') "
    "(message='Spiky loss')",
    "lightning.fabric.utilities.spike.TrainingSpikeException: Training spike detected in batch 120",
    "Monitored metric val_loss = nan is not finite. Previous best value was 2.117. Signaling "
    "Trainer to stop.",
    "Rank 7 found NaN in local grad norm in backward pass before data-parallel communication "
    "collective. Device: 7, node: n1",
    "Unexpected result 9.1e5 (message='found unexpected large grads in bucket #0 in backward "
    "pass before data-parallel communication collective')",
    "RuntimeError: The total norm of order 2.0 for gradients from `parameters` is non-finite, so "
    "it cannot be clipped.",
    "RuntimeError: Function 'LogSoftmaxBackward0' returned nan values in its 0th output.",
    "WARNING: The grad norm is nan. Skipping updating the model.",
    "WARN: rank 0 grad_norm is not finite: inf",
    "[WARN] bad grad_norm detected",
    "Detected inf/nan during batch_number=0",
    "Epoch 00012: reducing learning rate of group 0 to 1.0000e-04.",
    "Epoch 12: ReduceLROnPlateau reducing learning rate to 0.0001.",
]


def _heard(line: str) -> Heard | None:
    low = line.lower()
    return heard_early(low) or heard_in(low)


@pytest.mark.parametrize("index", range(len(WORDS)), ids=[row.needs for row in WORDS])
def test_every_row_reads_a_message_and_cites_its_source(index: int) -> None:
    row = WORDS[index]
    assert any((heard := _heard(line)) is not None and heard.words is row for line in EXAMPLES)
    assert row.trainer and row.source and row.means
    assert row.severity in (None, "warning", "error")
    assert row.early or any(word in row.needs for word in TRIGGERS)  # (the cheap test sees it)


@pytest.mark.parametrize(
    "line",
    [
        "iter 100: loss 2.3456, time 12.34ms",
        "INFO:tensorflow:loss = 1.8717, step = 31601 (182.200 sec)",
        "grad_norm: nan",  # a value: the numbers say it, no message
        "Saving checkpoint to checkpoints/step_100",
        "max_grad_norm: 1.0, skip_nan: True",
    ],
)
def test_other_lines_are_no_message(line: str) -> None:
    assert _heard(line) is None


def items(text: str) -> list[Item]:
    return parse_items("generic", text)


def test_a_log_whose_trouble_is_only_in_words_is_read() -> None:
    """TensorFlow's estimator prints no loss at all, only that it diverged (JiDong-CS/icme2019
    #14, on the unchanged code: "no training steps found")."""
    text = (
        "INFO:tensorflow:Saving checkpoints for 0 into finish/model.ckpt.\n"
        "ERROR:tensorflow:Model diverged with loss = NaN.\n"
        "E0410 22:34:13.729731 4483055104 basic_session_run_hooks.py:760] Model diverged with "
        "loss = NaN.\n"
        "tensorflow.python.training.basic_session_run_hooks.NanLossDuringTrainingError: NaN loss "
        "during training. \n"
    )
    found = items(text)
    records = [item for item in found if isinstance(item, StepRecord)]
    said = [item for item in found if isinstance(item, Finding)]
    assert len(records) == 1 and math.isnan(records[0].values["loss"])  # one event, 3 lines
    assert len(said) == 1 and said[0].kind == TRAINER_SAID
    assert said[0].severity == Severity.ERROR and "Model diverged" in said[0].seen
    assert said[0].step == records[0].step


def test_words_beside_numbers_land_after_the_last_step() -> None:
    """tensor2tensor#106: the loss at step 31601, then the trainer says it diverged."""
    text = (
        "INFO:tensorflow:loss = 1.8717, step = 31601 (182.200 sec)\n"
        "INFO:tensorflow:Saving checkpoints for 31622 into /home/t2t_train/model.ckpt.\n"
        "ERROR:tensorflow:Model diverged with loss = NaN.\n"
    )
    records = [item for item in items(text) if isinstance(item, StepRecord)]
    assert [r.step for r in records] == [31601, 31602]
    assert math.isnan(records[-1].values["loss"])


def test_a_message_on_every_rank_is_one_record() -> None:
    lines = [
        f"[deepspeed] OVERFLOW! Rank {rank} Skipping step. Attempted loss scale: 65536, reducing "
        "to 32768"
        for rank in range(4)
    ]
    lines += [
        line.replace("65536, reducing to 32768", "32768, reducing to 16384") for line in lines
    ]
    records = [item for item in items("\n".join(lines)) if isinstance(item, StepRecord)]
    assert [r.values["loss_scale"] for r in records] == [32768.0, 16384.0]


def test_the_same_message_at_another_time_is_another_event() -> None:
    """ESPnet says it skipped an update at every step it skips (espnet#3170)."""
    text = (
        "[user] 2021-04-23 19:22:52,420 (trainer:581) WARNING: The grad norm is nan. Skipping "
        "updating the model.\n"
        "[user] 2021-04-23 19:22:53,113 (trainer:581) WARNING: The grad norm is nan. Skipping "
        "updating the model.\n"
        "[user] 2021-04-23 19:22:56,245 (trainer:636) INFO: 2epoch:train:12009-12640batch: "
        "loss=65.129, loss_att=124.079\n"
    )
    records = [item for item in items(text) if isinstance(item, StepRecord)]
    assert [r.step for r in records] == [12638, 12639, 12640]
    assert all(r.values["skipped"] == 1.0 and math.isnan(r.values["grad_norm"])
               for r in records[:2])  # fmt: skip


def test_a_message_that_states_no_value_is_still_said() -> None:
    text = (
        "iter 1: loss 2.31\niter 2: loss 2.30\n[WARN] bad grad_norm detected\niter 3: loss 2.29\n"
    )
    found = items(text)
    said = [item for item in found if isinstance(item, Finding)]
    assert len(said) == 1 and said[0].severity == Severity.WARNING and said[0].step == 3
    assert [r.step for r in found if isinstance(r, StepRecord)] == [1, 2, 3]


def test_routine_words_give_values_and_no_finding() -> None:
    text = (
        "iter 10: loss 2.31\n"
        "Epoch 00012: reducing learning rate of group 0 to 1.0000e-04.\n"
        "iter 20: loss 2.30\n"
    )
    found = items(text)
    assert not any(isinstance(item, Finding) for item in found)
    assert [r.values for r in found if isinstance(r, StepRecord)][1] == {"lr": 1e-4}


def test_the_docs_table_lists_every_row() -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "readers.md").read_text()
    for row in WORDS:
        assert f"| `{row.pattern.replace('|', chr(92) + '|')}` | {row.trainer} |" in docs, row


@pytest.mark.parametrize(
    ("format", "text", "step"),
    [
        (
            "megatron",
            " iteration     1200/   50000 | consumed samples: 614400 | learning rate: 3.000E-04 "
            "| lm loss: 3.141593E+00 | loss scale: 1.0 | grad norm: 0.500 |\n"
            "Rank 0, node n1, device 0, iteration 1201: Unexpected result tensor(31.2, "
            "device='cuda:0') (message='Spiky loss')\n",
            1200,
        ),
        (
            "fairseq",
            "2024-01-01 12:00:00 | INFO | train_inner | epoch 001:    100 / 1000 loss=9.123, "
            "num_updates=100, lr=0.0005, gnorm=1.234, loss_scale=0.0001\n"
            "FloatingPointError: Minimum loss scale reached (0.0001). Your loss is probably "
            "exploding. Try lowering the learning rate, using gradient clipping or increasing the "
            "batch size.\n",
            101,
        ),
    ],
    ids=["megatron", "fairseq"],
)
def test_the_dedicated_readers_say_the_words_too(format: str, text: str, step: int) -> None:
    said = [item for item in parse_items(format, text) if isinstance(item, Finding)]
    assert [(f.kind, f.step) for f in said] == [(TRAINER_SAID, step)]


def test_paddlenlp_says_the_scale_after_its_skip() -> None:
    """PaddleNLP's "optimizer not run" is its scaler's skip, with the scale after it (PaddleNLP
    #7537: 0.25 -> 0.125 -> 0.0625, a cascade far below 1)."""
    paddle = _heard("[ WARNING] - optimizer not run, scale_before: 0.125, scale_after: 0.0625")
    assert paddle is not None and paddle.values == {"skipped": 1.0, "loss_scale": 0.0625}


def test_a_message_after_a_step_that_printed_no_value_is_of_that_step() -> None:
    """verl prints where it is (``[Global Step: 20] ...``) and, on a NaN/Inf gradient norm,
    only its words, on every rank (mm_search_r1#19: unread before, "no training steps found"):
    the message is that step's record, a skipped update with that norm."""
    text = (
        "[Global Step: 20] Update Actor Starts ...\n"
        "[Global Step: 20] Update Actor Ends ...\n"
        " WARN: rank 0 grad_norm is not finite: inf\n"
        "WARN: rank 1 grad_norm is not finite: inf\n"
    )
    records = [item for item in items(text) if isinstance(item, StepRecord)]
    assert [r.step for r in records] == [20]
    assert math.isinf(records[0].values["grad_norm"]) and records[0].values["skipped"] == 1.0
