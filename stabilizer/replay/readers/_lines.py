"""Decoded lines out of a byte stream, with bounded memory, for the console-log readers.

Console logs are messy: tqdm redraws its bar with ``\\r`` (one "line" may hold thousands of
redraws), colour codes wrap words in ANSI escapes, and a stray binary blob may have no newline for
100 MB. So the stream is decoded in 1 MiB chunks (UTF-8, or UTF-16 after its BOM; undecodable
bytes become U+FFFD), split at ``\\n``, ``\\r\\n`` *and* lone ``\\r``, ANSI escapes removed. A line
longer than `MAX_LINE` characters is skipped with a note and yielded as ``""``, so line numbers
stay right. Line numbers count ``\\r``-separated progress-bar fragments as lines.

`text_chunks` hands the lines out a list per chunk (the readers' hot loops iterate plain lists);
`text_lines` one at a time. `resume_banner` tells most lines that are no banner without its
case-blind regex.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterator
from typing import IO

from .base import Note, add_note

__all__ = [
    "CHUNK",
    "MAX_LINE",
    "RESUME",
    "encoding_of",
    "labels",
    "pick",
    "resume_banner",
    "text_chunks",
    "text_lines",
]

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


Labels = tuple[tuple[str, str, int], ...]


def labels(pairs: dict[str, str]) -> Labels:
    """``{label: key}`` prepared for `pick`."""
    return tuple((label, key, len(label)) for label, key in pairs.items())


def pick(line: str, start: int, wanted: Labels, stop: str) -> dict[str, float]:
    """The number after each wanted label of ``line`` (from ``start`` on, up to ``stop``), by key.

    ``str.find`` per label: several times faster than a regex alternation over a long line.
    """
    values, find = {}, line.find
    for label, key, size in wanted:
        at = find(label, start)
        if at >= 0:
            end = find(stop, at + size)
            try:
                values[key] = float(line[at + size : end] if end >= 0 else line[at + size :])
            except ValueError:
                continue
    return values


def resume_banner(line: str) -> str:
    """The line (cut to 80 characters) if it is a resume banner, else ``""``.

    An ASCII line without "resum", "load", "restor" or "continuing" (in any case) is no banner,
    and is told so without the slow case-blind regex (non-ASCII lines may hold letters that
    IGNORECASE folds to ASCII ones, such as ``ſ`` for ``s``: the regex decides).
    """
    if line.isascii():
        low = line.lower()
        if (
            "resum" not in low
            and "load" not in low
            and "restor" not in low
            and "continuing" not in low
        ):
            return ""
    return line.strip()[:80] if RESUME.search(line) else ""


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
    for lines in text_chunks(stream, notes, limit):
        yield from lines


def text_chunks(stream: IO[bytes], notes: list[Note], limit: int = MAX_LINE) -> Iterator[list[str]]:
    """`text_lines` a list at a time (one per chunk read): the hot loops of readers iterate lists.

    Line ``n`` (1-based) of the log is the ``n``-th line over all the lists.
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
        data = tail + text
        if "\x1b" in data:
            data = _ANSI.sub("", data)
        lines = data.splitlines()
        tail = _unfinished(data, lines) if raw else ""
        if len(tail) > limit:
            message = f"over-long line (> {limit} characters) skipped"
            add_note(notes, Note("skipped", message, count + len(lines) + 1))
            lines.append("")
            tail, skipping = "", True
        count += len(lines)
        if lines:
            yield lines


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
