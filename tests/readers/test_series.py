"""Which lines make one record, and which records one series: a progress bar's loss beside the
trainer's own records of the loss is a series of its own (shown, never judged), and the values
printed a line each under a counter's line are that counter's record. Each case is a real log's
lines (the source in its test); the cases it must catch were misread on the unchanged code, and
the cases beside them it must leave as they were."""

from __future__ import annotations

import math

from reader_cases import parse_items

from stabilizer.core.records import StepRecord
from stabilizer.replay.readers.aliases import BAR_LOSS
from stabilizer.replay.readers.universal.values import SUMMARY_LOSS


def records(text: str) -> list[StepRecord]:
    return [item for item in parse_items("generic", text) if isinstance(item, StepRecord)]


def series(text: str, key: str) -> list[float]:
    return [r.values[key] for r in records(text) if key in r.values]


def test_a_bar_loss_beside_the_trainers_own_record_is_a_series_of_its_own() -> None:
    """LiFT3D (lift3d#7): tqdm's postfix prints one batch's loss at the end of each epoch's bar,
    the trainer then its epoch's mean on an ``[INFO]`` line. The mean is the loss; the bar's is
    shown apart (read as one interleaved series, the batch losses 0.04-1.39 beside the means
    0.41 made a divergence of a healthy run)."""
    bar = "训练: Epoch {}/100: 100%|█████| 313/313 [13:08<00:00,  2.52s/it, loss={}, lr=0.001000]"
    text = "\n".join(
        f"{bar.format(epoch + 2, batch)}\n[INFO] [train] epoch={epoch}, loss={mean}"
        for epoch, batch, mean in ((41, 0.038908, 0.4148), (42, 0.1703, 0.4127), (43, 1.3856, 0.41))
    )
    assert series(text, "loss") == [0.4148, 0.4127, 0.41]
    assert series(text, BAR_LOSS) == [0.038908, 0.1703, 1.3856]


def test_a_mean_loss_line_after_a_bar_is_the_loss_the_bar_shown() -> None:
    """radar_detector#3: a bar's ``loss=1.95e+4`` at the end of the epoch, then the trainer's
    ``Mean Training loss : nan``: the NaN is the run's loss, not the bar's finite batch."""
    bar = "Epoch {}: 100%|█████| 266/266 [00:42<00:00,  6.22it/s, loss={}]"
    text = "".join(
        f"{bar.format(epoch, loss)}\nMean Training loss : nan\n"
        for epoch, loss in ((8, "1.95e+4"), (9, "9.77e+4"))
    )
    losses = series(text, "loss")
    assert len(losses) == 2 and all(math.isnan(loss) for loss in losses)
    assert series(text, BAR_LOSS) == [19500.0, 97700.0]


def test_a_bar_alone_is_the_loss() -> None:
    """NeMo/Lightning (NeMo#5928): the bar is the only record of the loss: it stays the loss."""
    bar = "Epoch 0:   0%|   | {}/351750 [00:04<204:24:55,  2.09s/it, loss={}, v_num=9-02]"
    text = "\n".join(bar.format(n, loss) for n, loss in ((1, 11), (2, 10.5), (3, 10.2)))
    assert series(text, "loss") == [11.0, 10.5, 10.2]
    assert series(text, BAR_LOSS) == []


def test_a_record_printed_after_a_bar_on_its_line_is_no_bar_loss() -> None:
    """The HF Trainer prints its ``{'loss': ...}`` right after tqdm's bar, with no newline
    between; a bar's own loss (in its description) may have text after the bar too
    (trace#5: ``...1.66s/it]Beginning of Epoch 2/18``). Neither is a second series."""
    glued = " 99%|█████ | {n}/3000 [00:59<09:09,  5.00it/s]{{'loss': {v}, 'epoch': 0.9}}\n"
    text = "".join(glued.format(n=n, v=v) for n, v in ((2990, 2.1649), (3000, 2.16)))
    text += "{'train_runtime': 1234.5, 'train_loss': 2.71, 'epoch': 1.0}\n"
    assert BAR_LOSS not in {key for r in records(text) for key in r.values}
    described = (
        "Epoch 1, Step 5, Loss: 1.1681:   5%|▍  | 7/144 [00:11<04:22,  1.92s/it]\n"
        "Epoch 1, Step 6, Loss: 1.2240:  6%|▌ | 8/144 [00:12<03:45, 1.66s/it]Beginning of Epoch 2\n"
        "Epoch 1, Step 7, Loss: 0.9610:   6%|▌  | 9/144 [00:13<03:00,  1.33s/it]\n"
    )
    assert series(described, "loss") == [1.1681, 1.224, 0.961]


def test_two_templates_of_one_series_stay_one() -> None:
    """lit-gpt prints ``(optimizer.step)`` after the lines of an optimizer step: two templates
    of lines that are no bar, one series of the loss."""
    text = (
        "iter 0 step 0: loss 10.55, iter time: 1957.89ms\n"
        "iter 1 step 1: loss 10.51, iter time: 1120.02ms (optimizer.step)\n"
        "iter 2 step 1: loss 10.49, iter time: 990.31ms\n"
        "iter 3 step 2: loss 10.40, iter time: 1002.4ms (optimizer.step)\n"
    )
    assert series(text, "loss") == [10.55, 10.51, 10.49, 10.40]


def test_the_values_under_a_counters_line_are_its_record() -> None:
    """Daniil-Osokin/lightweight-human-pose-estimation.pytorch#100: ``Iter: 3100`` after a bar's
    tail, then one loss part a line (one in markdown bold, as pasted): one record a block. Read a
    line a record, one block's four parts were four records 1-4, and the low block a baseline."""
    parts = ("stage1_pafs_loss", "stage1_heatmaps_loss", "stage2_pafs_loss", "stage2_heatmaps_loss")
    block = "".join(f"{name}:     {{{k}}}\n" for k, name in enumerate(parts))
    text = (
        block.format(132.3, 49.5, 128.0, 47.9)
        + "100%|██████████| 516/516 [12:00<00:00,  1.40s/it]\n"
        + "  1%|          | 4/516 [00:13<27:49,  3.26s/it]Iter: 3100\n"
        + block.format(5.46, 2.05, 5.28, "**1.97**")
        + " 20%|██        | 104/516 [02:42<10:42,  1.56s/it]\rIter: 3200\n"  # (a bar's \r too)
        + block.format(131.5, 49.4, 127.1, 47.7)
    )
    found = records(text)
    assert [r.step for r in found] == [3099, 3100, 3200]  # (the first block placed before)
    assert found[1].values == {
        **dict(zip(parts, (5.46, 2.05, 5.28, 1.97), strict=True)),
        "loss": 14.76,
    }
    assert [len(r.values) for r in found] == [5, 5, 5]


def test_values_alone_that_repeat_a_name_are_records_of_their_own() -> None:
    """A line of one value a step (``loss: 0.5``, ObjectGS's ``image_loss`` a line) is a record
    each time its name comes again: a block gathers different names only."""
    text = "loss: 0.52\nloss: 0.47\nlr: 0.001\nloss: 0.45\n"
    found = records(text)
    assert [r.values.get("loss") for r in found] == [0.52, 0.47, 0.45]
    assert found[1].values == {"loss": 0.47, "lr": 0.001}


def test_a_runs_summary_is_no_step_of_its_loss_series() -> None:
    """The HF Trainer's last dict (``train_runtime``, ``train_loss``: the mean over the whole run)
    read by the universal reader (a log whose head is a script's own prints): its loss is the
    run's mean, 0.1268 after losses that fell to 0.0014, which read as the loss made a 90x spike
    of a healthy run (round 7's held-out BERT MLM fine-tune). It is `SUMMARY_LOSS`, shown."""
    steps = "\n".join(
        f"{{'loss': {loss}, 'learning_rate': 1e-05, 'epoch': {epoch}}}"
        for loss, epoch in ((1.6282, 0.22), (0.072, 0.43), (0.0022, 2.16), (0.0014, 2.8))
    )
    text = (
        f"{steps}\n{{'train_runtime': 2331.9715, 'train_samples_per_second': 23.863, "
        "'train_steps_per_second': 2.983, 'train_loss': 0.1268128219462339, 'epoch': 3.0}\n"
    )
    assert series(text, "loss") == [1.6282, 0.072, 0.0022, 0.0014]
    assert series(text, SUMMARY_LOSS) == [0.1268128219462339]
