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

__all__ = ["CHUNK", "MAX_LINE", "RESUME", "Segments", "encoding_of", "resume_banner", "text_lines"]

CHUNK = 1 << 20  # bytes decoded at a time
MAX_LINE = 1 << 20  # characters; longer lines are skipped

_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")

_BREAK = re.compile(r"\r\n|[\n\r\v\f\x1c-\x1e\x85\u2028\u2029]")
_BREAKS = frozenset("\n\v\f\x1c\x1d\x1e\x85\u2028\u2029")  # line ends that end a line for sure

RESUME = re.compile(
    r"resum(?:e|ing|ed)\b.{0,40}(?:checkpoint|training|from)|"
    r"load(?:ing|ed) (?:model )?checkpoint(?! shards)|restor(?:ing|ed) (?:all )?states? from|"
    r"continuing training from checkpoint",
    re.IGNORECASE,
)
"""A resume banner (Lightning, HF, Megatron, DeepSpeed, fairseq, nanoGPT): starts a segment."""


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

    Args:
        stream: A binary stream positioned at the start of the log.
        notes: Over-long lines are reported here.
        limit: Lines longer than this many characters are skipped.
    """
    read = getattr(stream, "read1", stream.read)
    raw = read(CHUNK)
    decoder = codecs.getincrementaldecoder(encoding_of(raw))("replace")
    tail, skipping, count = "", False, 0  # unfinished line; inside an over-long line; lines done
    while raw:
        text = decoder.decode(raw)
        raw = read(CHUNK)
        if not raw:
            text += decoder.decode(b"", final=True)
        if skipping:  # drop the rest of the over-long line, up to its end
            text, skipping = _after_break(text)
            if skipping:
                continue
        data = _ANSI.sub("", tail + text)
        lines = data.splitlines()
        tail = _unfinished(data, lines) if raw else ""
        if len(tail) > limit:
            message = f"over-long line (> {limit} characters) skipped"
            add_note(notes, Note("skipped", message, count + len(lines) + 1))
            lines.append("")
            tail, skipping = "", True
        count += len(lines)
        yield from lines


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
