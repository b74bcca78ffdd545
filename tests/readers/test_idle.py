"""A followed log that waits: the readers hand out what they hold at `IDLE`, before reading on.

A scripted stream returns chunks, then `IDLE_CHUNK` (what `FollowedFile` returns when nothing new
is there), then more; each item is tagged with the number of reads made when it came out.
"""

from __future__ import annotations

import io
import struct

import pytest
from reader_cases import fixture

from stabilizer.core.records import StepRecord
from stabilizer.replay.readers import (
    Item,
    LightningCsvReader,
    MegatronReader,
    TensorBoardReader,
    UniversalReader,
)
from stabilizer.replay.readers._lines import IDLE, IDLE_CHUNK, numbered_lines, text_lines
from stabilizer.replay.readers.base import BaseReader
from stabilizer.replay.readers.universal.tables import numbered_blocks


class _Script:
    """A stream whose reads return the given chunks, then the end."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks, self.reads = list(chunks), 0

    def read1(self, size: int = -1) -> bytes:
        self.reads += 1
        return self.chunks.pop(0) if self.chunks else b""

    read = read1


def _tagged(reader: BaseReader, chunks: list[bytes]) -> list[tuple[int, Item]]:
    stream = _Script(chunks)
    return [(stream.reads, item) for item in reader.read(stream)]  # type: ignore[arg-type]


CASES = {
    "generic": (UniversalReader, b"iter 1: loss 2.5\niter 2: loss 2.4\n", b"iter 3: loss nan\n"),
    "megatron": (
        MegatronReader,
        b" iteration        1/     100 | lm loss: 2.5E+00 |\n"
        b" iteration        2/     100 | lm loss: 2.4E+00 |\n",
        b" iteration        3/     100 | lm loss: 2.3E+00 |\n",
    ),
    "lightning_csv": (
        LightningCsvReader,
        b"epoch,step,train_loss\n0,1,2.5\n0,2,2.4\n",
        b"0,3,2.3\n",
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_idle_hands_out_the_held_record_before_the_next_read(name: str) -> None:
    cls, first, more = CASES[name]
    idle = _tagged(cls(), [first, IDLE_CHUNK, more])
    plain = _tagged(cls(), [first, more])
    assert [item for _, item in idle] == [item for _, item in plain]  # the same records
    step2 = next(reads for reads, item in idle if isinstance(item, StepRecord) and item.step == 2)
    assert step2 == 2  # out at the IDLE (read 2), before `more` (read 3): not held back


def test_lines_of_a_chunk_come_before_the_next_read() -> None:
    stream = _Script([b"a\nb\npartial", b" line\n"])
    seen = [(stream.reads, line) for line in text_lines(stream, [])]  # type: ignore[arg-type]
    assert seen == [(1, "a"), (1, "b"), (2, "partial line")]


def test_idle_is_no_line_to_count() -> None:
    stream = _Script([b"a\n", IDLE_CHUNK, b"b\n"])
    lines = list(text_lines(stream, []))  # type: ignore[arg-type]
    assert lines == ["a", "", "b"] and lines[1] is IDLE
    again = _Script([b"a\n", IDLE_CHUNK, b"b\n"])
    numbered = list(numbered_lines(again, []))  # type: ignore[arg-type]
    assert numbered == [(1, "a"), (1, ""), (2, "b")] and numbered[1][1] is IDLE
    table = [n for n, _ in numbered_blocks(lines)]  # the universal reader's numbering
    assert table == [1, 1, 2]


def test_idle_hands_out_the_open_steps_of_an_event_file() -> None:
    data = next(fixture("tensorboard_failing/version_0").glob("events.out.tfevents.*")).read_bytes()
    cut = _record_boundary(data, len(data) // 2)
    idle = _tagged(TensorBoardReader(), [data[:cut], IDLE_CHUNK, data[cut:]])
    plain = _tagged(TensorBoardReader(), [data[:cut], data[cut:]])
    early = sum(1 for reads, _ in idle if reads <= 2)
    assert early > sum(1 for reads, _ in plain if reads <= 1)  # the window was handed out
    steps = [item.step for _, item in idle if isinstance(item, StepRecord)]
    assert len(steps) - len({*steps}) <= 1  # at most the step the cut fell in comes twice


def _record_boundary(data: bytes, near: int) -> int:
    """The offset of the first TFRecord that starts at or after ``near``."""
    offset = 0
    while offset < near:
        (length,) = struct.unpack_from("<Q", data, offset)
        offset += 12 + length + 4
    return offset


def test_without_idle_nothing_changes() -> None:
    text = b"iter 1: loss 2.5\n\niter 2: loss 2.4\n"
    assert list(UniversalReader().read(io.BytesIO(text))) == [
        StepRecord(1, {"loss": 2.5}),
        StepRecord(2, {"loss": 2.4}),
    ]
