"""`GenericReader`: the fallback for console logs of ``key: value`` or ``key=value`` pairs.

A line is a record when it holds a step-like key (``step``, ``iter``, ``iteration``,
``global_step``, ``num_updates``) with an integer, and at least one other numeric pair::

    2024-05-01 12:00:00 INFO step=120 loss=2.51 grad_norm=0.83 lr=3e-4
    Epoch 3 | iter: 4500 | train/loss: 2.31 | lr: 0.0003

Names map through the shared aliases (``train/loss`` → ``loss``, ``gnorm`` → ``grad_norm``, ...);
other numeric names pass through unchanged. A line may also read ``step 120/5000``. The reader
cannot know a format's quirks: prefer a specific reader when one fits.

Speed: most logs print every step the same way. `Layout` learns a record line's layout (its
names, separators and the text between them, digits generalised) and `Scan` matches whole chunks
of lines with one bytes regex specialised to it, without decoding them; lines it does not match
take the general path. The doc of `Layout` says why both paths find the same.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Generator, Iterator
from operator import itemgetter
from typing import IO, ClassVar

from stabilizer.core.records import StepRecord

from ._fields import Scan, line_pattern
from ._keys import SET, KeyMap
from ._lines import resume_banner
from .base import BaseReader, record

__all__ = ["GenericReader"]

_STEP_KEYS = ("global_step", "step", "iteration", "iter", "num_updates")  # by priority
_STEP = re.compile(r"\b(?:global_step|step|iteration|iter|num_updates) ?[:=]? ?(\d+)\b")
_PAIR = re.compile(  # a name that starts no later than a word does (the lookbehind keeps it
    # linear on long runs of name characters, and after the first letter it lets the regex scan
    # for letters fast); possessive: giving characters back never finds a match
    r"([A-Za-z_](?<![\w./-][A-Za-z_])[\w./-]*+) ?[:=] ?"
    r"((?>[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+|nan|inf|NaN|Inf)))(?=[\s,;|)\]]|$)"
)
# `_PAIR` for ASCII lines (``str.isascii`` costs nothing): there ``\w`` and ``\d`` are these
# classes, which sre tests by one bitmap lookup instead of a category check.
_VALUE = r"(?>[-+]?(?:[0-9]+\.?[0-9]*(?:[eE][-+]?[0-9]+)?|\.[0-9]+|nan|inf|NaN|Inf))"
_AFTER = r"(?=[\s,;|)\]]|$)"  # what may follow a value
_PAIR_ASCII = re.compile(
    r"([A-Za-z_](?<![-./0-9A-Z_a-z][A-Za-z_])[-./0-9A-Z_a-z]*+) ?[:=] ?(" + _VALUE + ")" + _AFTER
)
_Values = Callable[[tuple[str, ...]], dict[str, float]]
_DIGITS = re.compile(r"[0-9]+")
# What a layout captures of a value: looser than `_VALUE`, and faster; float() refuses the rest
# (the `Layout` doc).
_LOOSE = r"[-+]?(?:[0-9][-+.0-9eE]*|\.[0-9]+|nan|inf|NaN|Inf)"
_STEP_TEXT = r"[0-9]{1,15}"  # a step the layout takes: exact as float and int alike
_PLAIN_LINE = re.compile(r"[\t -~]*")  # a line `Scan` can match as bytes: tab, printable ASCII

PATIENCE = 8  # record lines off the layout, in a row, before a new layout is learnt
MAX_PATIENCE = 4096  # ... after lines that had none
MAX_LAYOUT = 2000  # characters of a line a layout is learnt from, at most
MAX_LAYOUTS = 64  # compiled layouts kept


class Layout:
    """A regex for whole chunks that finds, on each line of one layout, what `_PAIR` finds.

    The layout of a line is the sequence of its pairs (name, separator) and of the text between
    them (the *fillers*), learnt from one line where `_PAIR_ASCII` finds the pairs. The regex
    spells the names, separators and fillers literally, but for digit runs of the fillers
    (timestamps, epochs: ``[0-9]+``), and matches values with `_PAIR`'s value pattern. Why a line
    it matches has just these pairs: `_PAIR` treats digit runs alike whatever their length
    (``\\d+``, ``\\d*``, name characters), so on the fillers it finds nothing, as on the line the
    layout was learnt from; a filler before a name ends with no name character, so a search that
    starts in a filler cannot reach past the name's separator; a value is matched by the same
    atomic pattern and lookahead `_PAIR` uses, so its span is `_PAIR`'s. Everything the regex
    matches is ASCII, where `_PAIR` and `_PAIR_ASCII` agree.

    The general path's arithmetic is settled per layout: every name must land on its key as is
    (`KeyMap`'s ``SET``), later pairs of a key win, a step key must be there (the one
    `_STEP_KEYS` prefers; its digits are the step: ``[0-9]{1,15}``, so float and int agree; other
    steps fall back), and another key. The regex is a `line_pattern` over bytes, so it matches
    plain lines only (a layout is learnt from a plain line: its fillers are plain too), which are
    the same bytes as text: `Scan` hands out the captures of the lines of the layout (`Rows`).
    """

    __slots__ = ("findall", "pattern", "step", "values")

    def __init__(self, pattern: str, step: int, keys: tuple[str, ...], groups: list[int]) -> None:
        self.pattern = pattern
        self.findall = line_pattern(pattern.encode()).findall
        self.step = step  # index of the step's digits in a tuple
        # a tuple → the record's values (float() raises ValueError for a value `_PAIR` refuses)
        self.values = _values(keys, groups)

    @classmethod
    def learn(cls, line: str, keys: KeyMap) -> Layout | None:
        """The layout of a record line, or None when it cannot have one (see the class doc)."""
        if len(line) > MAX_LAYOUT or not _PLAIN_LINE.fullmatch(line):
            return None
        matches = list(_PAIR_ASCII.finditer(line))
        mapped: list[str] = []
        for match in matches:
            found = keys.lookup(match[1])
            if found is None or found[1] != SET:
                return None
            mapped.append(found[0])
        last = {key: i for i, key in enumerate(mapped)}  # later pairs win
        step_key = next((key for key in _STEP_KEYS if key in last), None)
        order = [key for key in dict.fromkeys(mapped) if key not in _STEP_KEYS]
        if step_key is None or not order:
            return None
        captured = sorted([last[key] for key in order] + [last[step_key]])
        parts: list[str] = []
        pos = 0
        for i, match in enumerate(matches):
            named = line[match.start() : match.start(2)]  # the name and separator
            parts += _filler(line[pos : match.start()]), re.escape(named)
            if i == last[step_key]:
                parts.append(f"({_STEP_TEXT})")
            else:
                parts.append(f"({_LOOSE})" if i in captured else _VALUE)
            pos = match.end()
        parts += _filler(line[pos:]), r"\r?\n"
        group = {pair: at for at, pair in enumerate(captured)}  # pair → index in a tuple
        groups = [group[last[key]] for key in order]
        return cls("".join(parts), group[last[step_key]], tuple(order), groups)


class GenericReader(BaseReader):
    """Reads any log of ``key: value`` / ``key=value`` pairs with a step (the module doc)."""

    format: ClassVar[str] = "generic"

    @classmethod
    def sniff(cls, head: list[str]) -> float:
        keys = KeyMap()
        hits = sum(1 for line in head if _step_and_values(line, keys) is not None)
        return 0.25 if hits >= 2 else 0.15 if hits else 0.0

    def _records(self, stream: IO[bytes]) -> Iterator[StepRecord]:
        layouts, last, banner, lineno = _Layouts(KeyMap()), -1, "", 0
        scan = Scan(stream, self.notes)
        for item in scan:
            if isinstance(item, list):  # lines off the layout
                last, banner, lineno = yield from self._general(
                    item, scan, layouts, (last, banner, lineno)
                )
                continue
            layout: Layout = item.pattern  # type: ignore[assignment]  # (the one that matched)
            values_of, at = layout.values, layout.step
            for index, row in enumerate(item.rows):
                try:
                    values = values_of(row)
                except ValueError:  # a value `_PAIR` may refuse: the general path decides
                    state = last, banner, lineno
                    last, banner, lineno = yield from self._general(
                        [item.line(index)], scan, layouts, state
                    )
                    continue
                lineno += 1
                found, layouts.misses = int(row[at]), 0
                if found < last or banner:
                    self.segment(found, last, banner, lineno)
                    banner = ""
                last = found
                yield record(found, values)

    def _general(
        self, lines: list[str], scan: Scan, layouts: _Layouts, state: tuple[int, str, int]
    ) -> Generator[StepRecord, None, tuple[int, str, int]]:
        """The records of ``lines``, read the general way; learns a layout from the record lines
        off the current one (`_Layouts.missed`). Returns the last step, a banner, a line number."""
        last, banner, lineno = state
        for line in lines:
            lineno += 1
            found, values = _parse(line, layouts.keys)
            if found is None:
                banner = banner or _banner(line, last)
                continue
            if layouts.missed(line):
                scan.pattern = layouts.layout  # (`Scan` matches with it from its next chunk on)
            if found < last or banner:
                self.segment(found, last, banner, lineno)
                banner = ""
            last = found
            yield record(found, values)
        return last, banner, lineno


class _Layouts:
    """Which `Layout` a reader matches chunks with, learnt from the record lines it misses.

    A new layout is learnt after `PATIENCE` record lines in a row missed the current one (the
    first from the first record line); a line that gives none (or the same) doubles the patience,
    up to `MAX_PATIENCE`, so logs without one pay little for trying. `Scan` matches a chunk with
    the layout of its start: a chunk is matched once, whatever the layouts learnt within it.
    """

    def __init__(self, keys: KeyMap) -> None:
        self.keys = keys
        self.layout: Layout | None = None
        self.misses, self.patience = 0, 1

    def missed(self, line: str) -> bool:
        """Count a record line off the layout; whether a new layout was learnt from it."""
        self.misses += 1
        if self.misses < self.patience:
            return False
        self.misses = 0
        new = Layout.learn(line, self.keys)
        if new is None or (self.layout is not None and new.pattern == self.layout.pattern):
            self.patience = min(2 * self.patience, MAX_PATIENCE)
            return False
        self.layout, self.patience = new, PATIENCE
        return True


def _banner(line: str, last: int) -> str:
    """A resume banner, looked for once a record was read."""
    return resume_banner(line) if last >= 0 else ""


def _filler(text: str) -> str:
    """A regex for text between pairs: literal, but for ``[0-9]+`` for each digit run."""
    return "[0-9]+".join(map(re.escape, _DIGITS.split(text)))


def _values(keys: tuple[str, ...], at: list[int]) -> _Values:
    """A tuple → ``{keys[i]: float(tuple[at[i]])}``: for up to five keys a dict display, twice as
    fast as ``dict(zip(keys, map(float, ...)))`` is for so few."""
    if len(keys) == 1:
        (k,), (a,) = keys, at
        return lambda r: {k: float(r[a])}
    if len(keys) == 2:
        (k, j), (a, b) = keys, at
        return lambda r: {k: float(r[a]), j: float(r[b])}
    if len(keys) == 3:
        (k, j, m), (a, b, c) = keys, at
        return lambda r: {k: float(r[a]), j: float(r[b]), m: float(r[c])}
    if len(keys) == 4:
        (k, j, m, n), (a, b, c, d) = keys, at
        return lambda r: {k: float(r[a]), j: float(r[b]), m: float(r[c]), n: float(r[d])}
    if len(keys) == 5:
        (k, j, m, n, o), (a, b, c, d, e) = keys, at
        return lambda r: {
            k: float(r[a]),
            j: float(r[b]),
            m: float(r[c]),
            n: float(r[d]),
            o: float(r[e]),
        }
    texts = itemgetter(*at)
    return lambda r: dict(zip(keys, map(float, texts(r)), strict=True))


def _parse(line: str, keys: KeyMap) -> tuple[int | None, dict[str, float]]:
    """The general path: the step of a line (None: no record) and its other values."""
    pairs = _PAIR_ASCII.findall(line) if line.isascii() else _PAIR.findall(line)
    try:  # every name seen before: `KeyMap.rename` without its frame
        names = keys.names
        values = {names[name]: float(text) for name, text in pairs}
    except (KeyError, ValueError):
        values = keys.rename(pairs)
    return _step(line, values), values


def _step_and_values(line: str, keys: KeyMap) -> tuple[int, dict[str, float]] | None:
    """The step and the other values of a line with a step-like key and another number."""
    values = keys.rename(_PAIR.findall(line))
    step = _step(line, values)
    return None if step is None else (step, values)


def _step(line: str, values: dict[str, float]) -> int | None:
    """The step of a line whose named numbers are ``values`` (step keys are popped off them)."""
    step: float | None = None
    for name in _STEP_KEYS:
        if name in values:
            number = values.pop(name)
            step = number if step is None else step
    if step is None and ("step" in line or "iter" in line):
        match = _STEP.search(line)
        step = float(match.group(1)) if match else None
    if step is None or not values or not math.isfinite(step) or step != int(step):
        return None
    return int(step)
