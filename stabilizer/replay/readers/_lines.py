"""Decoded lines out of a byte stream, with bounded memory, and where a console log's run restarts.

Console logs are messy: tqdm redraws its bar with ``\\r`` (one "line" may hold thousands of
redraws), colour codes wrap words in ANSI escapes, and a stray binary blob may have no newline for
100 MB. So the stream is decoded in 1 MiB chunks (UTF-8, or UTF-16 after its BOM; undecodable
bytes become U+FFFD), split at ``\\n``, ``\\r\\n`` *and* lone ``\\r``, ANSI escapes removed. A line
longer than `MAX_LINE` characters is skipped with a note and yielded as ``""``, so line numbers
stay right. Line numbers count ``\\r``-separated progress-bar fragments as lines.

`Segments` tells a console reader where the run restarts: the step went back, or a resume banner
(`RESUME`) came between two records.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterator
from typing import IO

from .base import Note, Restart, add_note

__all__ = [
    "ANSI",
    "CHUNK",
    "IDLE",
    "IDLE_CHUNK",
    "MAX_LINE",
    "RESUME",
    "Segments",
    "encoding_of",
    "numbered_lines",
    "resume_banner",
    "text_lines",
]

CHUNK = 1 << 20  # bytes decoded at a time
MAX_LINE = 1 << 20  # characters; longer lines are skipped

ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")

_BREAK = re.compile(r"\r\n|[\n\r\v\f\x1c-\x1e\x85\u2028\u2029]")
_BREAKS = frozenset("\n\v\f\x1c\x1d\x1e\x85\u2028\u2029")  # line ends that end a line for sure

RESUME = re.compile(
    r"resum(?:e|ing|ed)\b.{0,40}(?:checkpoint|training|from)|"
    r"load(?:ing|ed) (?:model )?checkpoint(?! shards)|restor(?:ing|ed) (?:all )?states? from|"
    r"continuing training from checkpoint",
    re.IGNORECASE,
)
"""A resume banner (Lightning, HF, Megatron, DeepSpeed, fairseq, nanoGPT): starts a segment."""


class _IdleLine(str):
    """The type of `IDLE`: an empty line that is no line."""

    __slots__ = ()


IDLE = _IdleLine()
"""The line `text_lines` yields when a followed log has no more for now (`IDLE_CHUNK`).

It equals ``""``, so a reader that does not know it reads an empty line; a reader that holds a
record back until the next line (to join the lines of one step) hands it out on ``line is
IDLE``, since the next line may be long in coming. `numbered_lines` does not count it.
"""


class _IdleChunk(bytes):
    """The type of `IDLE_CHUNK`."""

    __slots__ = ()


IDLE_CHUNK = _IdleChunk()
"""What a followed stream's ``read1`` returns when it has nothing now, once after some data:
`text_lines` turns it into `IDLE` (an empty ``bytes``; told apart by ``is``)."""


def resume_banner(line: str) -> str:
    """The line (cut to 80 characters) if it is a resume banner, else ``""``."""
    return line.strip()[:80] if RESUME.search(line) else ""


class Segments:
    """Where a log's run restarts, told record by record.

    A reader hands over each record's step (`restart`) and yields the `Restart` it returns, if
    any, just before the record; it hands over each line that is no record (`other`), in which a
    resume banner is looked for once a record was read.
    """

    def __init__(self) -> None:
        self.last: int | None = None  # the step of the last record
        self.banner = ""  # a resume banner seen since the last record

    def other(self, line: str) -> None:
        """Look for a resume banner in a line that holds no record."""
        if self.last is not None and not self.banner:
            self.banner = resume_banner(line)

    def restart(self, step: int, line: int | None) -> Restart | None:
        """The `Restart` that comes before a record of ``step`` (at log ``line``), if any."""
        last, banner = self.last, self.banner
        self.last, self.banner = step, ""
        if last is None or not (step < last or banner):
            return None
        why = f"resume banner {banner!r}" if banner else f"step went back from {last} to {step}"
        return Restart(step, line, why)


def encoding_of(head: bytes) -> str:
    """The codec of a text log from its first bytes: UTF-16 after its BOM, else UTF-8."""
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return "utf-16"
    return "utf-8-sig"  # strips a UTF-8 BOM when there is one


def text_lines(stream: IO[bytes], notes: list[Note], limit: int = MAX_LINE) -> Iterator[str]:
    """The lines of ``stream`` without line ends (see the module docstring).

    The lines of a chunk are yielded before the next chunk is read, so a stream that waits for
    more (a pipe, a followed log) hands out every line it has; an `IDLE_CHUNK` read from it
    becomes the line `IDLE`.

    Args:
        stream: A binary stream positioned at the start of the log.
        notes: Over-long lines are reported here.
        limit: Lines longer than this many characters are skipped.
    """
    for lines in _chunks(stream, notes, limit):
        yield from lines


def numbered_lines(
    stream: IO[bytes], notes: list[Note], limit: int = MAX_LINE
) -> Iterator[tuple[int, str]]:
    """`text_lines` with their 1-based numbers; `IDLE` comes with the number of the line before
    it. What a console reader loops over: one generator between the bytes and the reader."""
    count = 0
    for lines in _chunks(stream, notes, limit):
        if lines is _IDLE_LINES:
            yield count, IDLE
            continue
        yield from enumerate(lines, count + 1)
        count += len(lines)


_IDLE_LINES: list[str] = [IDLE]


def _chunks(stream: IO[bytes], notes: list[Note], limit: int) -> Iterator[list[str]]:
    """The lines of each chunk of ``stream`` (`_IDLE_LINES` for an `IDLE_CHUNK`)."""
    read = getattr(stream, "read1", stream.read)
    raw = read(CHUNK)
    splitter = _Splitter(encoding_of(raw), notes, limit)
    while raw or raw is IDLE_CHUNK:
        yield _IDLE_LINES if raw is IDLE_CHUNK else splitter.feed(raw)
        raw = read(CHUNK)
    yield splitter.end()


class _Splitter:
    """Decoded text cut into lines, chunk by chunk; the last, unfinished line is held back."""

    def __init__(self, encoding: str, notes: list[Note], limit: int) -> None:
        self.decoder = codecs.getincrementaldecoder(encoding)("replace")
        self.notes, self.limit = notes, limit
        self.tail, self.skipping, self.count = "", False, 0  # unfinished line; inside an
        # over-long line; lines done

    def feed(self, raw: bytes) -> list[str]:
        """The lines that ``raw`` finishes."""
        text = self.decoder.decode(raw)
        if self.skipping:  # drop the rest of the over-long line, up to its end
            text, self.skipping = _after_break(text)
            if self.skipping:
                return []
        data = ANSI.sub("", self.tail + text)
        lines = data.splitlines()
        self.tail = _unfinished(data, lines)
        if len(self.tail) > self.limit:
            message = f"over-long line (> {self.limit} characters) skipped"
            add_note(self.notes, Note("skipped", message, self.count + len(lines) + 1))
            lines.append("")
            self.tail, self.skipping = "", True
        self.count += len(lines)
        return lines

    def end(self) -> list[str]:
        """The last line, if it did not end with a line break."""
        text = self.decoder.decode(b"", final=True)
        if self.skipping:
            text, self.skipping = _after_break(text)
            if self.skipping:
                return []
        return ANSI.sub("", self.tail + text).splitlines()


def _unfinished(data: str, lines: list[str]) -> str:
    """Pop and return the last line of ``data`` if it may continue in the next chunk."""
    if not lines or data[-1] in _BREAKS:
        return ""
    if data[-1] == "\r":  # maybe the first half of \r\n: keep the \r for the next split
        return lines.pop() + "\r"
    return lines.pop()


def _after_break(text: str) -> tuple[str, bool]:
    """``text`` after its first line break, and whether there was none (still skipping)."""
    match = _BREAK.search(text)
    return ("", True) if match is None else (text[match.end() :], False)
