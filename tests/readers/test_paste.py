"""A pasted log is read as the log it holds; what is no wrapper stays as printed."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from stabilizer.cli import main
from stabilizer.core.records import StepRecord
from stabilizer.replay.diagnose import diagnose
from stabilizer.replay.readers import read_log
from stabilizer.replay.readers._paste import Paste
from stabilizer.replay.readers._unwrap import head_paste, unwrapped_head

LOG = ["iter 100: loss 2.3456, time 12.34ms", "", "iter 110: loss nan, time 12.30ms"]


def unwrap(lines: list[str]) -> list[str]:
    """The lines as the readers get them."""
    data = "\n".join(lines).encode()
    paste = head_paste(data)
    return lines if paste is None else unwrapped_head(data, paste).decode().split("\n")


@pytest.mark.parametrize(
    ("pasted", "what"),
    [
        (["```", *LOG, "```"], "fences or a prompt line"),
        (["```text", *LOG], "fences or a prompt line"),
        (["> " + LOG[0], ">", "> " + LOG[2]], "'> ' quotes"),
        (["> > " + LOG[0], "> >", "> > " + LOG[2]], "'> ' quotes"),
        (["> ```", "> " + LOG[0], ">", "> " + LOG[2], "> ```"], "'> ' quotes, fences or"),
        ([f"{i:>6}\t{line}" for i, line in enumerate(LOG, 1)], "line numbers"),
        ([f"{i:>4} | {line}" for i, line in enumerate(LOG, 40)], "line numbers"),  # a gutter
        ([f"{i}:{line}" for i, line in enumerate(LOG, 1)], "line numbers"),  # grep -n
        (["\t" + LOG[0], "", "\t" + LOG[2]], "an indent"),
        (["    " + LOG[0], "", "    " + LOG[2]], "an indent"),
        (["$ python train.py --max_iters 5000 --lr 3e-4", *LOG], "fences or a prompt line"),
        (["(venv) me@gpu01:~/nanoGPT$ python train.py", *LOG], "fences or a prompt line"),
    ],
    ids=[
        "fence", "opening-fence", "quote", "nested-quote", "quoted-fence", "cat-n", "gutter",
        "grep-n", "tab", "four-blanks", "prompt", "venv-prompt",
    ],
)  # fmt: skip
def test_a_wrapper_comes_off(pasted: list[str], what: str) -> None:
    paste = head_paste("\n".join(pasted).encode())
    assert paste is not None and paste.what.startswith(what)
    kept = [line for line in unwrap(pasted) if line]
    assert kept == [line for line in LOG if line]


@pytest.mark.parametrize(
    "prefix",
    [
        "2024-05-01 12:00:00,123 - INFO - ",  # %(asctime)s - %(levelname)s - %(message)s
        "2024-05-01 12:00:00,123 - __main__ - INFO - ",
        "05/01/2024 12:00:00 - INFO - transformers.trainer - ",  # Hugging Face examples
        "2024-05-01 12:00:00.123 | INFO     | __main__:train:42 - ",  # loguru
        "[2024-05-01 12:00:00,123] [INFO] ",
        "[2024-05-01 12:00:00,123][INFO] - ",
        "2024-05-01T12:00:00.123Z INFO ",
        "I0501 12:00:00.123456 140230 train.py:42] ",  # absl
        "INFO:root:",  # basicConfig's default
        "WARNING:__main__:",
        "[12:00:00] INFO     ",
    ],
)
def test_a_loggers_prefix_comes_off(prefix: str) -> None:
    assert unwrap([prefix + line for line in LOG]) == LOG


def test_a_wrapper_outside_a_native_prefix_comes_off_layer_by_layer() -> None:
    native = [f"[2018-11-26 15:06:0{i},481 INFO] Step {i}/50000; xent: 2.{i}" for i in range(10)]
    native.append("  a line of its own")
    quoted = ["> " + line for line in native]
    read = [f"Step {i}/50000; xent: 2.{i}" for i in range(10)] + ["  a line of its own"]
    assert unwrap(quoted) == unwrap(native) == read


@pytest.mark.parametrize(
    "lines",
    [
        ["step 1 loss 2.0", "step 2 loss 1.9", "step 3 loss 1.8"],  # words of the message
        ["step: 1 loss: 2.0", "step: 2 loss: 1.9"],
        ["Train: epoch 1 loss 2.0", "Train: epoch 2 loss 1.9"],
        ["12: loss 2.0", "13: loss 1.9", "14: loss 1.8"],  # a count, not the line's number
        ["1\t2.0", "2\t1.9"] * 0 + ["5\t2.0", "6\t1.9"],  # a TSV of steps from 5
        # OLMo: a step line, then its metrics indented below it
        ["[step=120/20000,epoch=0]", "    train/CrossEntropyLoss=11.25", "    train/Z=3.1"],
        [" iteration 10/ 100 | lm loss: 3.0E+00 |", " iteration 20/ 100 | lm loss: 2.9E+00 |"],
        ["s:12 trl:9.79 lr:0.0001 norm:3.01", "s:13 trl:9.71 lr:0.0001 norm:2.90"],  # llm.c
        ["12:30:00 is not a step", "12:31:00 neither"],
    ],
    ids=["words", "colons", "word-colon", "count", "tsv", "olmo", "megatron", "llmc", "clock"],
)
def test_what_is_no_wrapper_stays(lines: list[str]) -> None:
    kept = unwrap(lines)
    if lines[0].startswith("12:30"):  # a bare clock time first is a logger's prefix
        assert kept == ["is not a step", "neither"]
        return
    assert kept == lines


def test_a_prefix_on_nine_lines_in_ten_comes_off_where_it_is() -> None:
    lines = [f"2024-05-01 12:00:{i:02d},000 - INFO - step {i} loss 2.{i}" for i in range(9)]
    lines.append("Traceback (most recent call last):")
    assert unwrap(lines)[:9] == [f"step {i} loss 2.{i}" for i in range(9)]
    assert unwrap(lines)[9] == lines[9]


def test_a_table_after_a_bracketed_prefix_keeps_its_bars() -> None:
    """Of two ways to read ``[INFO] | loss | nan |``, the one every line shares: a blank."""
    rows = ["-" * 20, "| loss | nan |", "| step | 1.53e+05 |", "-" * 20]
    assert unwrap([f"[12:00:0{i}] [INFO] {row}" for i, row in enumerate(rows)]) == rows


def test_a_plain_log_has_no_wrapper() -> None:
    assert Paste.of(LOG) is None
    assert Paste.of([]) is None


def test_line_numbers_stay_those_of_the_file(tmp_path: Path) -> None:
    path = tmp_path / "pasted.log"
    path.write_text("```\n> iter 1: loss 2.0\n> iter 2: loss 2.1\n```\n")
    stream = read_log(path)
    records = [item for item in stream if isinstance(item, StepRecord)]
    assert [r.step for r in records] == [1, 2]
    assert any("read as pasted" in note.message for note in stream.notes)


def test_a_long_paste_reads_whole(tmp_path: Path) -> None:
    """Past the first chunk, across a CRLF cut in two and an over-long line, every line is
    unwrapped."""
    lines = [f"> iter {i}: loss {2 + i % 7 / 10}" for i in range(1, 60_001)]
    lines[30_000] = "> " + "x" * 1_100_000  # over-long: skipped by the reader
    path = tmp_path / "long.log"
    path.write_bytes("\r\n".join(lines).encode())
    records = [item for item in read_log(path) if isinstance(item, StepRecord)]
    assert len(records) == 59_999 and records[-1].step == 60_000


def test_utf16_paste(tmp_path: Path) -> None:
    path = tmp_path / "utf16.log"
    path.write_bytes("> iter 1: loss 2.0\n> iter 2: loss nan\n".encode("utf-16"))
    records = [item for item in read_log(path) if isinstance(item, StepRecord)]
    assert [r.step for r in records] == [1, 2]


def test_a_fenced_two_line_nan_is_a_nan(tmp_path: Path) -> None:
    """Issue #32's lost case: a fenced paste was refused as a markdown document."""
    path = tmp_path / "issue.log"
    path.write_text("```\nEpoch 1: loss 2.31\nEpoch 2: loss nan\n```\n")
    result = CliRunner().invoke(main, ["diagnose", str(path)])
    assert result.exit_code == 1, result.output
    assert [f.kind for f in (x.finding for x in diagnose(str(path)).findings)] == ["nonfinite_loss"]


def test_a_record_glued_to_the_opening_fence_is_read(tmp_path: Path) -> None:
    """openbmb/MiniCPM-V#212: ```{'loss': 1.0778, ...} opens the paste; the record was taken for
    the fence's info string and dropped, and with it the finite loss before the HF Trainer's
    0.0s (its NaNs); a fence's info string names a language, never holds a record."""
    lines = [
        "{'loss': 1.0778, 'grad_norm': nan, 'learning_rate': 0.0, 'epoch': 0.0}",
        *(
            f"{{'loss': 0.0, 'grad_norm': nan, 'learning_rate': {i}e-07, 'epoch': 0.0}}"
            for i in range(1, 6)
        ),
    ]
    path = tmp_path / "issue.log"
    path.write_text("```" + "\n".join(lines) + "\n```\n")
    records = [item for item in read_log(path) if isinstance(item, StepRecord)]
    assert [r.values["loss"] for r in records][:1] == [1.0778] and len(records) == 6
    glued = tmp_path / "glued.log"  # any record, not only a dict
    glued.write_text("```iter 1: loss 2.31\niter 2: loss 2.30\n```\n")
    assert [r.step for r in read_log(glued) if isinstance(r, StepRecord)] == [1, 2]
    tagged = tmp_path / "tagged.log"
    tagged.write_text("```text\n" + "\n".join(lines) + "\n```\n")  # an info string: no line
    assert len([item for item in read_log(tagged) if isinstance(item, StepRecord)]) == 6


def test_a_pasted_issue_with_headings_is_still_its_log(tmp_path: Path) -> None:
    """Told apart from a README by its training records, not by its markdown around them."""
    body = [
        "### Describe the bug",
        "Training breaks after a while, see [the docs](https://example.org).",
        "### Logs",
        "```",
        *(f"iter {i}: loss {3 - i / 100:.2f}" for i in range(10)),
        "iter 10: loss nan",
        "```",
    ]
    path = tmp_path / "issue.md"
    path.write_text("\n".join(body) + "\n")
    kinds = [x.finding.kind for x in diagnose(str(path)).findings]
    assert kinds == ["nonfinite_loss"]
