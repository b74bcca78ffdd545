"""`Templates`: a record line whose template the reader has learnt is read by one regex match.

A log prints its records from a few format strings: what stays from line to line is the
template, what varies are its numbers (log-template mining, as in `shapes`). Once the full path
of `reader` has read a record line (its step from a named counter, its metrics by name), the
line's template is learnt: the line with each of its runs of digits as ``[0-9]+``, the step's,
the other counters' and each value's number a group. A later line that the template matches
whole is read by that one match: its step, its counters and its values are the groups' numbers,
with the keys the full path gave. Any other line takes the full path.

Why a line the template matches reads as the full path reads it: the two differ only in their
digits, and the full path's regexes (the step's, the pairs', the evaluation words', the
catalogue's overflow lines') treat every ASCII digit alike and any count of them alike (``\\d+``,
``[\\w./-]``), save what a template keeps as printed or is never learnt from:

- digits in a name (``top1``, ``layer.0``): the key is the name, so they stay as printed;
- a run of digits before ``,<digit>`` where a value may start (after a name and a separator:
  ``loss: 9,876`` is 9876, ``loss: 0,234`` is 0: a thousands separator needs a first digit of
  1-9 and groups of three), and the runs after it: they stay as printed;
- a line whose reading depends on more than its text, or whose numbers are no groups: an epoch
  (a count within it counts on from the epochs before), a step from a count or a key rather
  than a named counter, an evaluation's line, a value that is no plain number (NaN, inf, a
  thousands separator), a table's row or a line with an escape code (rewritten before it is
  read), a line that lower-casing lengthens (the step is found in the lower-cased line).

A template is kept only if it reads its own line as the full path did. The templates are
bounded (`MAX_TEMPLATES`, the oldest dropped), and learning waits while it does not pay
(`SLACK` more templates learnt than lines read by one): a log whose lines do not repeat costs
one failed match a line more. docs/readers.md, "Learnt templates".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import pairwise

from .steps import counter_spans
from .values import Span, spans_of

__all__ = ["MAX_TEMPLATES", "SLACK", "Read", "Templates"]

MAX_TEMPLATES = 16  # templates matched at once (one regex of alternatives)
SLACK = 64  # templates learnt beyond the lines they read before learning waits

_DIGITS = re.compile(r"[0-9]+")
_NUMBER = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
_BEFORE_NUMBER = " \t:=\uff1a[('\"]+-"  # what may stand between a name and its number
_NAME_END = re.compile(r"[\w./-]*\Z")

Read = tuple[int, tuple[int, ...], dict[str, float]]
"""A line read by its template: its step, every counter it prints, its values."""


@dataclass(frozen=True, slots=True)
class _Template:
    """A learnt template: its regex, and what its groups are."""

    pattern: str  # the regex: the line, a group for each counter and each value
    order: tuple[int, ...]  # the groups (numbered by place) of the counters, then the values
    counters: int  # how many counters: the step, then the line's other counters
    keys: tuple[str, ...]  # the keys of the values, in the order the full path gives them


class Templates:
    """The templates of the record lines read so far, and the lines they read."""

    def __init__(self) -> None:
        self._known: list[_Template] = []  # in the order learnt
        self._regex: re.Pattern[str] | None = None  # every template, one alternative each
        self._at: dict[int, tuple[_Template, tuple[int, ...]]] = {}  # by its alternative's group
        self.learnt = 0
        self.hits = 0

    def read(self, line: str) -> Read | None:
        """The step, counters and values of a line a learnt template matches whole, or None."""
        found = self._regex.fullmatch(line) if self._regex is not None else None
        if found is None:
            return None
        self.hits += 1
        template, groups = self._at[found.lastindex or 0]
        texts = found.group(*groups)  # (two groups at least: a step and a value)
        return _read(template, texts)

    def learn(self, line: str, low: str, read: Read) -> None:
        """Learn the template of a record line that the full path read as ``read`` (a step from a
        named counter; a loss or a gradient norm among its values), unless its reading depends
        on more than its digits (see the module docstring)."""
        if self.learnt > self.hits + SLACK or not _plain(line, low):
            return
        template = _template(line, low, read)
        if template is None or any(known.pattern == template.pattern for known in self._known):
            return
        self.learnt += 1
        self._known = [*self._known[-(MAX_TEMPLATES - 1) :], template]
        parts, self._at, group = [], {}, 1
        for each in self._known:  # one alternative each, in a group whose number says which
            parts.append(f"({each.pattern})")
            self._at[group] = (each, tuple(group + index for index in each.order))
            group += 1 + len(each.order)
        self._regex = re.compile("|".join(parts))


def _read(template: _Template, texts: tuple[str, ...]) -> Read:
    """The step, counters and values of a template's groups' texts (in `_Template.order`)."""
    count = template.counters
    step = int(texts[0])
    where = (step,) if count == 1 else tuple(map(int, texts[:count]))
    return step, where, dict(zip(template.keys, map(float, texts[count:]), strict=True))


def _plain(line: str, low: str) -> bool:
    """Whether a line may be read by a template (the cheap tests of the module docstring)."""
    return len(low) == len(line) and "epoch" not in low and "\x1b" not in line


def _template(line: str, low: str, read: Read) -> _Template | None:
    """The template of a line read as ``read``, or None if it cannot be one (the module
    docstring) or would read the line otherwise."""
    counters = counter_spans(low)
    spans, names = spans_of(line)
    if len(counters) != len(read[1]) or list(spans) != list(read[2]):
        return None  # (a step that no named counter gave; values not all by name)
    groups = counters + list(spans.values())
    if any(_NUMBER.fullmatch(line, *span) is None for span in groups):
        return None  # ("inf", "1,234": no plain number)
    made = _pattern(line, groups, _literal(line, names))
    if made is None:
        return None
    pattern, order = made
    template = _Template(pattern, order, len(counters), tuple(spans))
    found = re.fullmatch(pattern, line)
    if found is None or _read(template, found.group(*order)) != read:
        return None
    return template


def _pattern(
    line: str, groups: list[Span], literal: set[int]
) -> tuple[str, tuple[int, ...]] | None:
    """The regex of a line's template (each run of digits ``[0-9]+`` but those that start in
    ``literal``, each span of ``groups`` a group, the rest as printed), and the number of each
    group in it; None where two groups overlap or one cuts a run of digits."""
    runs = {run.start(): run.end() for run in _DIGITS.finditer(line)}
    bounds = sorted(groups)
    if any(a[1] > b[0] for a, b in pairwise(bounds)):
        return None  # (two groups on one number: a "total" that is the loss too)
    if any(
        start < at < end
        for at in {at for span in groups for at in span}
        for start, end in runs.items()
    ):
        return None
    opens, closes = {start for start, _ in groups}, {end for _, end in groups}
    out, at = [], 0
    while at < len(line):
        out += [")"] * (at in closes) + ["("] * (at in opens)
        end = runs.get(at)
        if end is None:
            out.append(re.escape(line[at]))
            at += 1
        else:
            out.append(re.escape(line[at:end]) if at in literal else "[0-9]+")
            at = end
    out += [")"] * (len(line) in closes)
    return "".join(out), tuple(1 + bounds.index(span) for span in groups)


def _literal(line: str, names: list[Span]) -> set[int]:
    """The starts of the runs of digits a template keeps as printed: those in a name, and those
    of a number with thousands separators where a value may start (the module docstring)."""
    runs = list(_DIGITS.finditer(line))
    kept = {run.start() for run in runs if any(a <= run.start() < b for a, b in names)}
    for run, after in pairwise(runs):
        if after.start() != run.end() + 1 or line[run.end()] != ",":
            continue  # (no thousands separator after it)
        if run.start() in kept or _may_start(line[: run.start()]):
            kept.update((run.start(), after.start()))  # ("1,234,567": the runs after it too)
    return kept


def _may_start(before: str) -> bool:
    """Whether a value may start after ``before``: a name (a word with a letter in it) ends it,
    but for separators, quotes, brackets and a sign (`values._PAIR`)."""
    word = _NAME_END.search(before.rstrip(_BEFORE_NUMBER))
    return word is not None and any(c.isascii() and (c.isalpha() or c == "_") for c in word[0])
