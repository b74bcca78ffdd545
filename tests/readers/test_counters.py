"""The one list of counter names (`COUNTERS`) and what is derived from it; overflow lines."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from stabilizer.core.records import StepRecord
from stabilizer.replay.readers import detect_format, read_log
from stabilizer.replay.readers._lines import text_lines
from stabilizer.replay.readers.universal import UniversalReader
from stabilizer.replay.readers.universal.steps import COUNTERS, STEP_NAMES, Counter, Steps
from stabilizer.replay.readers.universal.values import key_of
from stabilizer.replay.readers.words import overflow_of

EXAMPLES = {"s": "s:7 trl:2.5", "up.": "Up. 7 cost 2.5"}  # (counters that need more than a blank)


def _records(text: str) -> list[StepRecord]:
    found = UniversalReader().read_lines(text_lines(io.BytesIO(text.encode()), []))
    return [item for item in found if isinstance(item, StepRecord)]


@pytest.mark.parametrize("counter", COUNTERS, ids=[c.name for c in COUNTERS])
def test_every_counter_of_the_list_is_a_step_and_no_metric(counter: Counter) -> None:
    name = counter.name
    line = EXAMPLES.get(name, f"{name} 7 loss 2.5")
    assert Steps().of(line.lower())[0] == 7, line
    assert [(r.step, r.values) for r in _records(line)] == [(7, {"loss": 2.5})]
    assert name in STEP_NAMES and key_of(name) is None


@pytest.mark.parametrize(
    ("line", "step"),
    [
        ("iter 8 step 1 loss 2.0", 1),
        ("Ep. 1 : Up. 14000 : step 5 : cost 2.5", 5),  # "up." and "step" on one line
        ("global_step 90 step 3 loss 1.0", 90),
        ("iteration 4 batch 2 loss 1.0", 4),
    ],
)
def test_of_two_counters_on_a_line_the_earlier_in_the_list_wins(line: str, step: int) -> None:
    assert Steps().of(line.lower())[0] == step


def test_a_marian_line_with_two_counters_reads_without_error(tmp_path: Path) -> None:
    """Regression: ``Up.`` beside ``step`` raised ValueError (the sort knew no ``up.``)."""
    path = tmp_path / "train.log"
    path.write_text(
        "Ep. 1 : Up. 14000 : step 5 : cost 2.5\nEp. 1 : Up. 14100 : step 6 : cost 2.4\n"
    )
    assert detect_format(path) == "generic"
    assert [r.step for r in read_log(path) if isinstance(r, StepRecord)] == [5, 6]


def test_a_kv_table_row_of_a_counter_is_the_step() -> None:
    text = "-" * 20 + "\n| global_step | 120 |\n| loss | 2.5 |\n" + "-" * 20 + "\n"
    assert [(r.step, r.values) for r in _records(text)] == [(120, {"loss": 2.5})]


@pytest.mark.parametrize(
    ("line", "values"),
    [
        ("[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 64, reducing to 32",
         {"skipped": 1.0, "loss_scale": 32.0}),
        ("Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 512.0",
         {"skipped": 1.0, "loss_scale": 512.0}),
        ("Found NaN, decreased lg_loss_scale to 19.0",
         {"skipped": 1.0, "loss_scale": 2.0**19, "lg_loss_scale": 19.0}),
    ],
)  # fmt: skip
def test_overflow_lines_are_read_through_one_test(line: str, values: dict[str, float]) -> None:
    found = overflow_of(line)
    assert found is not None and found[0] == values
    assert overflow_of("step 5 loss 2.0 scale 1.0") is None


@pytest.mark.parametrize("quote", ['"', "'"])
def test_a_dict_counted_only_by_its_epoch_key_is_stepped_by_it(quote: str) -> None:
    """A record whose only counter is a quoted ``epoch`` key (DINO's log.txt, one dict an epoch)
    is at its epoch, as ``epoch 151 loss ...`` is: not at its order in the log (which would
    read an excerpt from epoch 151 as the run's start)."""
    q = quote
    lines = [f"{{{q}train_loss{q}: 11.09, {q}epoch{q}: {e}}}" for e in (151, 152)]
    assert [r.step for r in _records("\n".join(lines) + "\n")] == [151, 152]
    assert [r.step for r in _records("epoch 151 loss 11.09\nepoch 152 loss 11.09\n")] == [151, 152]


@pytest.mark.parametrize(
    ("lines", "steps", "onward"),
    [
        # a count that starts over each epoch counts on from the epoch before (one run)
        (["epoch: 1, iter: 100", "epoch: 1, iter: 200", "epoch: 2, iter: 100"], [100, 200, 300], 1),
        (
            ["Epoch 1 Batch 0", "Epoch 1 Batch 10", "Epoch 2 Batch 0", "Epoch 2 Batch 10"],
            [0, 10, 11, 21],
            1,
        ),
        # a count that did not start over counts the run (fairseq's num_updates)
        (["epoch 001 | num_updates 100", "epoch 002 | num_updates 250"], [100, 250], 0),
        # an epoch that went back, or a count that went back within one, is a new run
        (["epoch 1 iter 100", "epoch 2 iter 50", "epoch 1 iter 10"], [100, 150, 10], 1),
        (["epoch 3 iter 300", "epoch 3 iter 100"], [300, 100], 0),
    ],
)
def test_a_count_with_no_total_counts_on_across_epochs(
    lines: list[str], steps: list[int], onward: int
) -> None:
    """``print(f"epoch: {epoch}, iter: {i}, loss: {loss}")``: each epoch was read as a new run
    (a restart at each epoch, the baselines started over); its count is within the epoch, and
    the notes say the steps count on."""
    where = Steps()
    assert [where.of(line.lower())[0] for line in lines] == steps
    text = "".join(f"{line} loss {2.5 - k / 10}\n" for k, line in enumerate(lines))
    reader = UniversalReader()
    read = list(reader.read_lines(text_lines(io.BytesIO(text.encode()), [])))
    restarts = [item for item in read if not isinstance(item, StepRecord)]
    assert bool(restarts) == (steps != sorted(steps))
    said = [note for note in reader.notes if "starts over each epoch" in note.message]
    assert len(said) == onward
