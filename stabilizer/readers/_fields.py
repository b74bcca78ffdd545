"""The fast path of the console-log readers: their usual lines matched as bytes, a chunk at once.

`text_chunks` decodes every byte, removes ANSI escapes and splits at every kind of line end. Once
a 1 MiB chunk holds one non-ASCII character (a tqdm bar's ``█``) the whole chunk is decoded to
two bytes a character, and decoding, the escape scan and splitting cost ~2 µs per 300-character
line: as much as reading the line's fields. Yet most lines of a training log are plain ASCII, and
the bytes of such a line between two ``\\n`` are exactly the line `text_chunks` would give.

`scan` reads the stream as `text_chunks` does (the same reads, decoder, tail and over-long
handling) and gives the same lines in the same order, except that whole lines matched by the
reader's ``pattern`` (a bytes regex, ``re.MULTILINE``, matching one *plain* line from ``^`` through
its ``\\n``: tab and printable ASCII only, so no escape, no other line end, nothing to decode) come
as `re.Match` objects, one ``sre`` scan over the chunk instead of a call per line. Everything else
comes decoded, as lists of lines. A chunk where that could differ from `text_chunks` (an OSC escape
``ESC ]``, which may run over line ends; an escape left open at the chunk's start; UTF-16; no
``\\n``; a line longer than the limit) is read the `text_chunks` way whole.

`Floats` converts value texts to floats, remembering recent ones: a loss scale, a skip count or a
learning rate repeats over many lines, and a dict lookup costs a third of a `float` call.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Generator, Iterator
from typing import IO

from . import _lines
from ._lines import _ANSI, MAX_LINE, _after_break, _unfinished, encoding_of
from .base import Note, add_note

__all__ = ["PLAIN", "Floats", "Scan", "decoded"]

PLAIN = rb"\t -~"
"""The bytes of a plain line, for a character class: tab and printable ASCII."""

_MEMO = 1024  # value texts remembered by a `Floats`


class Floats(dict[bytes, float]):
    """``floats[text]`` is ``float(text)`` (ValueError for no number), remembered.

    At most `_MEMO` texts are kept: the memo starts over when full, so memory does not grow with
    the log. ``map(floats.__getitem__, texts)`` converts known texts without a Python call.
    """

    __slots__ = ()

    def __missing__(self, text: bytes) -> float:
        if len(self) >= _MEMO:
            self.clear()
        value = self[text] = float(text)
        return value


def _osc(raw: bytes) -> bool:
    """Whether ``raw`` holds an OSC escape (``ESC ]``), found by ``ESC`` (one byte: ``find`` scans
    for it several times faster than for the two bytes; past 64 escapes, the two bytes)."""
    at = raw.find(b"\x1b")
    for _ in range(64):
        if at < 0:
            return False
        if raw[at + 1 : at + 2] == b"]":
            return True
        at = raw.find(b"\x1b", at + 1)
    return at >= 0 and b"\x1b]" in raw[at:]


def decoded(data: bytes) -> list[str]:
    """The lines of whole UTF-8 lines ``data`` (ending in ``\\n``), as `text_chunks` gives them."""
    text = data.decode("utf-8", "replace")
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    return text.splitlines()


class Scan:
    """The lines of a stream: plain lines that ``pattern`` matches as matches, the rest as lists.

    Iterate once. ``pattern`` may be set (or set to None) while iterating: the scan uses the new
    one from the line after the item just handed out. Line ``n`` of the log is the ``n``-th line
    over everything handed out, a match counting one.

    Args:
        stream: A binary stream at the start of the log.
        notes: Over-long lines are reported here (as by `text_chunks`).
        pattern: See the module docstring; None: every line comes in a list.
        limit: Lines longer than this many characters are skipped (as by `text_chunks`).
    """

    def __init__(
        self,
        stream: IO[bytes],
        notes: list[Note],
        pattern: re.Pattern[bytes] | None = None,
        limit: int = MAX_LINE,
    ) -> None:
        self.stream, self.notes, self.pattern, self.limit = stream, notes, pattern, limit

    def __iter__(self) -> Iterator[re.Match[bytes] | list[str]]:
        """`text_chunks`, step by step, but a chunk's lines between its first and last ``\\n``
        (its body) scanned as bytes (see the module docstring for when and why)."""
        read = getattr(self.stream, "read1", self.stream.read)
        raw = read(_lines.CHUNK)
        codec = encoding_of(raw)
        self._decoder = codecs.getincrementaldecoder(codec)("replace")
        self._tail, self._skipping, self._count = "", False, 0
        while raw:
            first = -1
            if (
                codec == "utf-8-sig"
                and not (self._skipping or "\x1b" in self._tail or _osc(raw))
                and len(raw) <= self.limit
            ):
                first = raw.find(b"\n")
            after = read(_lines.CHUNK)
            if first < 0:
                lines = self._text(raw, final=not after)
                if lines:
                    yield lines
                raw = after
                continue
            # The head (the tail and the chunk's first line) and the rest (after its last "\n")
            # as text; no escape runs over a "\n" (no OSC), so each part's escapes are its own.
            last = raw.rfind(b"\n")
            yield self._text(raw[: first + 1], final=False)
            self._count += yield from self._body(raw[first + 1 : last + 1])
            lines = self._text(raw[last + 1 :], final=not after)
            if lines:  # (shorter than the chunk, so than the limit: no over-long line)
                yield lines
            raw = after

    def _text(self, raw: bytes, final: bool) -> list[str]:
        """The lines ``raw`` completes, the `text_chunks` way (its tail kept for the next)."""
        text = self._decoder.decode(raw, final=final)
        if self._skipping:  # drop the rest of the over-long line, up to its end
            text, self._skipping = _after_break(text)
            if self._skipping:
                return []
        data = self._tail + text
        if "\x1b" in data:
            data = _ANSI.sub("", data)
        lines = data.splitlines()
        self._tail = "" if final else _unfinished(data, lines)
        if len(self._tail) > self.limit:
            message = f"over-long line (> {self.limit} characters) skipped"
            add_note(self.notes, Note("skipped", message, self._count + len(lines) + 1))
            lines.append("")
            self._tail, self._skipping = "", True
        self._count += len(lines)
        return lines

    def _body(self, body: bytes) -> Generator[re.Match[bytes] | list[str], None, int]:
        """The whole lines ``body``: matches, and the lines between decoded; returns the count."""
        at, size, count = 0, len(body), 0
        while at < size:
            pattern = self.pattern
            matches = () if pattern is None else pattern.finditer(body, at)
            for match in matches:
                start = match.start()
                if start != at:
                    lines = decoded(body[at:start])
                    count += len(lines)
                    yield lines
                    at = start
                    if self.pattern is not pattern:
                        break  # a new pattern from this line on
                at = match.end()
                count += 1
                yield match
                if self.pattern is not pattern:
                    break
            else:
                if at < size:
                    lines = decoded(body[at:])
                    count += len(lines)
                    yield lines
                return count
        return count
