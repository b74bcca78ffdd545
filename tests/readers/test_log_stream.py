"""`LogStream`, what `read_log` returns: format, bytes, restarts, findings, notes; and the
bugs it fixed: stdin closed by `read_log`, notes without bound."""

from __future__ import annotations

import gc
import gzip
import io
import math
import sys
from pathlib import Path

import pytest
from reader_cases import fixture, records

from stabilizer.core.records import Finding, Severity, StepRecord
from stabilizer.replay.readers import (
    MAX_NOTES,
    LogReadError,
    LogStream,
    Note,
    Restart,
    _lines,
    add_note,
    read_log,
)


def test_stream_tells_format_path_bytes_and_restarts(tmp_path: Path) -> None:
    path = tmp_path / "train.log"
    lines = [f"iter {s}: loss 2.0, time 1ms, mfu 1%" for s in (*range(10), *range(5, 10))]
    path.write_text("\n".join(lines) + "\n")
    stream = read_log(path)
    assert isinstance(stream, LogStream)
    assert (stream.format, stream.path, stream.total_bytes) == (
        "generic",
        str(path),
        path.stat().st_size,
    )
    found = list(stream)
    assert len(found) == 16 and found[10] == Restart(5, 11, "step went back from 9 to 5")
    assert stream.bytes_read == path.stat().st_size
    assert stream.notes == []


def test_bytes_read_of_gzip_counts_the_compressed_file(tmp_path: Path) -> None:
    path = tmp_path / "train.log.gz"
    path.write_bytes(gzip.compress(fixture("megatron_healthy.log").read_bytes()))
    stream = read_log(path)
    assert stream.format == "megatron" and stream.total_bytes == path.stat().st_size
    list(stream)
    assert stream.bytes_read == path.stat().st_size


def test_stream_of_a_run_directory_and_its_notes() -> None:
    notes: list[Note] = []
    stream = read_log(fixture("tensorboard_healthy"), notes=notes)
    assert stream.format == "tensorboard" and stream.notes is notes
    assert list(stream) == records("tensorboard_healthy")  # no restart


def test_stream_carries_the_monitors_own_findings_where_the_log_has_them(tmp_path: Path) -> None:
    finding = Finding("nonfinite_loss", 2, 2, Severity.ERROR, "loss is nan", {"loss": math.nan})
    path = tmp_path / "stability.jsonl"
    path.write_text(f"{StepRecord(1, {'loss': 2.5}).to_json()}\n{finding.to_json()}\n")
    stream = read_log(tmp_path)
    assert stream.format == "jsonl"
    assert list(stream) == [StepRecord(1, {"loss": 2.5}), finding]


def test_next_and_close() -> None:
    stream = read_log(fixture("nanogpt_healthy.log"))
    first, second = records("nanogpt_healthy.log")[:2]
    assert next(stream) == first and next(iter(stream)) == second
    stream.close()
    assert list(stream) == []


def test_stdin_format_is_known(monkeypatch: pytest.MonkeyPatch) -> None:
    data = gzip.compress(fixture("megatron_healthy.log").read_bytes())
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    stream = read_log("-")
    assert (stream.format, stream.path, stream.total_bytes) == ("megatron", "-", None)
    assert list(stream) == records("megatron_healthy.log")


@pytest.mark.parametrize(
    "data", [b"", gzip.compress(b"", mtime=0), b"iter 1: loss 2.0, time 1ms\n"]
)
def test_stdin_is_never_closed(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    """Regression: an empty stdin was closed by `open_source`, a read one on collection."""
    stdin = io.TextIOWrapper(io.BytesIO(data))
    monkeypatch.setattr(sys, "stdin", stdin)
    try:
        list(read_log("-"))
    except LogReadError as exc:
        assert str(exc) == "standard input: empty (nothing was written to it)"
    gc.collect()
    assert not stdin.buffer.closed


def test_notes_are_capped_per_kind() -> None:
    notes: list[Note] = [Note("source", "reading x")]
    kept = [add_note(notes, Note("skipped", f"line {i} skipped", i)) for i in range(1, 1001)]
    add_note(notes, Note("format", "a quirk"))
    assert kept == [True] * MAX_NOTES + [False] * (1000 - MAX_NOTES)
    skipped = [n for n in notes if n.kind == "skipped"]
    assert len(skipped) == MAX_NOTES + 1
    assert skipped[-1].message == f"{1000 - MAX_NOTES} more skipped notes like the above"
    assert [n.kind for n in notes].count("format") == 1


def test_over_long_lines_leave_bounded_notes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: one note per over-long line, without bound."""
    monkeypatch.setattr(_lines, "CHUNK", 64)
    data = "".join(f"iter {s}: loss 2.0\n{'x' * 300}\n" for s in range(100)).encode()
    notes: list[Note] = []
    lines = list(_lines.text_lines(io.BytesIO(data), notes, limit=100))
    assert len(lines) == 200 and lines[198] == "iter 99: loss 2.0" and lines[199] == ""
    assert len(notes) == MAX_NOTES + 1
    assert str(notes[0]) == "line 2: over-long line (> 100 characters) skipped"
    assert notes[-1].message == f"{100 - MAX_NOTES} more skipped notes like the above"


def test_a_for_loop_outlives_the_stream_object() -> None:
    """``for r in read_log(...)`` drops the `LogStream` at once: the files must stay open."""
    count = 0
    for _ in read_log(fixture("nanogpt_healthy.log")):
        if count == 1:
            gc.collect()
        count += 1
    assert count == len(records("nanogpt_healthy.log"))


def test_note_cap_counts_in_a_list_filled_by_others() -> None:
    notes = [Note("skipped", f"someone else's {i}") for i in range(MAX_NOTES + 3)]
    assert not add_note(notes, Note("skipped", "mine"))
    assert not add_note(notes, Note("skipped", "mine again"))
    assert notes[-1].message == "2 more skipped notes like the above"
    assert len(notes) == MAX_NOTES + 4
