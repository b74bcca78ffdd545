"""The fast path of the console-log readers: their usual lines matched as bytes, a chunk at once.

`text_chunks` decodes every byte, removes ANSI escapes and splits at every kind of line end. Once
a 1 MiB chunk holds one non-ASCII character (a tqdm bar's ``█``) the whole chunk is decoded to
two bytes a character, and decoding, the escape scan and splitting cost ~2 µs per 300-character
line: as much as reading the line's fields. Yet most lines of a training log are plain ASCII, and
the bytes of such a line between two ``\\n`` are exactly the line `text_chunks` would give.

`scan` reads the stream as `text_chunks` does (the same reads, decoder, tail and over-long
handling) and gives the same lines in the same order, except that whole lines matched by the
reader's line pattern (a bytes regex matching one *plain* line from its start through its ``\\n``:
tab and printable ASCII only, so no escape, no other line end, nothing to decode) come as the
pattern's groups, a run of consecutive lines at once (`Rows`): one ``findall`` over the chunk
instead of a call per line, and a reader can convert a run column by column, in C. Everything
else comes decoded, as lists of lines. A chunk where that could differ from `text_chunks` (an OSC
escape ``ESC ]``, which may run over line ends; an escape left open at the chunk's start; UTF-16;
no ``\\n``; a line longer than the limit) is read the `text_chunks` way whole.

`Floats` converts value texts to floats, remembering recent ones: a loss scale, a skip count or a
learning rate repeats over many lines, and a dict lookup costs a third of a `float` call.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable, Generator, Iterator, Sequence
from itertools import compress, count, pairwise
from operator import itemgetter, lt
from typing import IO, Any, Protocol

from stabilizer.replay.readers import _lines

from ._lines import _ANSI, MAX_LINE, _after_break, _unfinished, encoding_of
from .base import Note, add_note

__all__ = [
    "PLAIN",
    "Floats",
    "LinePattern",
    "Rows",
    "Scan",
    "column",
    "decoded",
    "line_pattern",
    "stretches",
]

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


def column(texts: Sequence[bytes], floats: Callable[[bytes], float]) -> list[float]:
    """``list(map(floats, texts))``, a column of one text over and over (a loss scale, a skip
    count: the usual case) converted once (comparing texts costs less than hashing them)."""
    if texts.count(texts[0]) == len(texts):
        return [floats(texts[0])] * len(texts)
    return list(map(floats, texts))


def stretches(steps: list[int]) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of each stretch of ``steps`` that does not go back, in order: found in C,
    so a reader can make a stretch's records at once (nothing to note within one)."""
    edges = [0, *compress(count(1), map(lt, steps[1:], steps)), len(steps)]
    return pairwise(edges)


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


def line_pattern(line: bytes) -> re.Pattern[bytes]:
    """A pattern for `Scan`: ``line`` (a regex of one whole plain line, through its ``\\n``) or,
    failing that, any line, as the last group.

    Every line of a chunk's body is so one match, in order (a match starts at a line's start and
    ends at its ``\\n``), and a line ``line`` did not match is the one with the last group set.
    """
    return re.compile(rb"^(?:" + line + rb"|([^\n]*\n))", re.MULTILINE)


class LinePattern(Protocol):
    """What `Scan` needs of a pattern: the groups of its matches, as a `line_pattern` gives them
    (a reader may pass an object of its own that carries more, such as its layout)."""

    def findall(self, string: bytes, /) -> list[Any]: ...


class _Body:
    """A chunk's body (whole lines), split into lines only when some line is asked for."""

    __slots__ = ("data", "lines")

    def __init__(self, data: bytes) -> None:
        self.data, self.lines = data, list[bytes]()

    def line(self, index: int) -> bytes:
        """Line ``index`` of the body, without its ``\\n``."""
        if not self.lines:
            self.lines = self.data.split(b"\n")  # once: any number of lines asked for is linear
        return self.lines[index]


class Rows:
    """Consecutive plain lines of a chunk that ``pattern`` matched: their groups, in order.

    Attributes:
        pattern: The pattern that matched them (a reader's pattern may change while it reads a
            chunk: these lines are of the one the chunk's body was matched with).
        rows: Each line's groups (the last, `line_pattern`'s any-line group, empty).
    """

    __slots__ = ("_body", "_first", "pattern", "rows")

    def __init__(self, pattern: LinePattern, rows: list[Any], body: _Body, first: int) -> None:
        self.pattern, self.rows, self._body, self._first = pattern, rows, body, first

    def line(self, index: int) -> str:
        """The text of row ``index``'s line, as `text_chunks` gives it (it is plain: decoded)."""
        return self._body.line(self._first + index).decode().rstrip("\r")


def decoded(data: bytes) -> list[str]:
    """The lines of whole UTF-8 lines ``data`` (ending in ``\\n``), as `text_chunks` gives them."""
    text = data.decode("utf-8", "replace")
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    return text.splitlines()


class Scan:
    """The lines of a stream: plain lines that ``pattern`` matches as `Rows`, the rest as lists.

    Iterate once. ``pattern`` may be set (or set to None) while iterating: the scan uses the new
    one from the next chunk's body on (a body is matched whole, at once; `Rows` say which pattern
    matched them). Line ``n`` of the log is the ``n``-th line over everything handed out, a row
    counting one.

    Args:
        stream: A binary stream at the start of the log.
        notes: Over-long lines are reported here (as by `text_chunks`).
        pattern: A `line_pattern` (or an object with its ``findall``); None: every line comes in a
            list.
        limit: Lines longer than this many characters are skipped (as by `text_chunks`).
    """

    def __init__(
        self,
        stream: IO[bytes],
        notes: list[Note],
        pattern: LinePattern | None = None,
        limit: int = MAX_LINE,
    ) -> None:
        self.stream, self.notes, self.pattern, self.limit = stream, notes, pattern, limit

    def __iter__(self) -> Iterator[Rows | list[str]]:
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

    def _body(self, body: bytes) -> Generator[Rows | list[str], None, int]:
        """The whole lines ``body``: runs of matched lines as `Rows`, the lines between decoded;
        returns the count."""
        pattern = self.pattern
        if pattern is None:
            lines = decoded(body)
            yield lines
            return len(lines)
        rows = pattern.findall(body)  # a row a line (see `line_pattern`)
        others = list(compress(range(len(rows)), map(itemgetter(-1), rows)))  # unmatched lines
        others.append(len(rows))  # (an end: no line)
        whole, count, at, k = _Body(body), 0, 0, 0
        while at < len(rows):
            if others[k] > at:  # rows at... matched
                yield Rows(pattern, rows[at : others[k]], whole, at)
                count += others[k] - at
                at = others[k]
                continue
            end = at  # rows at... not matched: decoded together
            while others[k] == end < len(rows):
                k, end = k + 1, end + 1
            lines = decoded(b"".join([row[-1] for row in rows[at:end]]))
            count += len(lines)
            yield lines
            at = end
        return count
