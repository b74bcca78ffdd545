"""Opening a log for a diagnosis: `read_log`, plus the name of the format it was read as.

`stabilizer.readers.read_log` detects the format itself but does not say which it found, and a
report must. For a file or a directory the format is detected first (`detect_format`) and then
passed to `read_log`. Standard input cannot be read twice, so its first bytes are read here,
detected, and served again to `read_log` in front of the rest of the stream.
"""

from __future__ import annotations

import io
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from ..readers import LogReadError, Note, TensorBoardReader, detect_format, read_log
from ..records import StepRecord

__all__ = ["STDIN", "open_log", "sniff_head"]

STDIN = "-"
_HEAD = 1 << 16  # bytes of standard input looked at for detection
_GZIP = b"\x1f\x8b"


def open_log(
    path: str, format: str = "auto", notes: list[Note] | None = None
) -> tuple[str, Iterator[StepRecord]]:
    """The format name and the streamed records of a log file, directory or ``-`` (stdin).

    The name is ``"auto"`` only for a named pipe read with ``format="auto"`` (the reader found
    the format, but a pipe cannot be read twice to tell which).

    Args:
        path: A file (plain or gzip), a run directory, or ``-``.
        format: A reader name, or ``"auto"`` to detect it.
        notes: Collects the reader's notes.

    Raises:
        LogReadError: The log cannot be read at all (see `read_log`).
    """
    if path == STDIN:
        return _open_stdin(format, notes)
    if format == "auto" and (Path(path).is_file() or Path(path).is_dir()):
        format = detect_format(path)  # not for a pipe (``<(zcat log.gz)``): it reads only once
    return format, read_log(path, format, notes=notes)


class _Chain(io.RawIOBase):
    """``head`` again, then the rest of ``stream`` (which it does not close)."""

    def __init__(self, head: bytes, stream: IO[bytes]) -> None:
        self._head, self._stream = memoryview(head), stream
        self._read = getattr(stream, "read1", stream.read)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        if self._head:
            size = min(len(buffer), len(self._head))
            buffer[:size], self._head = self._head[:size], self._head[size:]
            return size
        data = self._read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def _open_stdin(format: str, notes: list[Note] | None) -> tuple[str, Iterator[StepRecord]]:
    stdin = sys.stdin
    head = stdin.buffer.read(_HEAD)
    if format == "auto":
        format = sniff_head(head)
    replay = io.BufferedReader(_Chain(head, stdin.buffer))
    wrapper = io.TextIOWrapper(replay)
    sys.stdin = wrapper  # read_log opens sys.stdin.buffer at once, while it is this one
    try:
        records = read_log(STDIN, format, notes=notes)
    finally:
        sys.stdin = stdin
        if not replay.closed:  # (read_log closes it when stdin is empty)
            wrapper.detach()  # so that collecting the wrapper does not close the stream
    return format, records


def sniff_head(head: bytes) -> str:
    """The format of a log from its first bytes, or ``"auto"`` when they do not tell.

    Gzip data is inflated as far as it goes; ``"auto"`` leaves the verdict (and the error message
    for binary or unknown data) to `read_log`.
    """
    if head.startswith(_GZIP):
        try:
            head = zlib.decompressobj(wbits=31).decompress(head)
        except zlib.error:
            return "auto"
    if TensorBoardReader.sniff_bytes(head) > 0.5:
        return TensorBoardReader.format
    lines = [line for line in head.decode("utf-8", "replace").splitlines() if line.strip()]
    try:
        return detect_format(lines) if lines else "auto"
    except LogReadError:
        return "auto"
