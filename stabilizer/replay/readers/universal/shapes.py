"""`Shapes`: lines whose numbers no name says, read by the shape they repeat (log templates).

Log-template mining (Drain, He et al. 2017) reads a file's lines as templates: the tokens that
stay from line to line are the template, those that vary are its values. A line that the rules
of names do not read (no ``name: value`` in it) may still be a record by its shape: bare
columns (``76930 2.6496577``, ``209,nan,0.001``) or a scalar tensor printed as it is
(``tensor(3.2207, device='cuda:0')``). Its shape is the line with each number as ``#``; once a
shape has come `REPEATS` times its lines are a series, and the slots of its numbers are read
from how they vary:

- a slot whose values are integers that rise line after line is the step (no name says so: the
  counter of the series);
- the first other slot that varies is the loss, the others ``column_<n>`` (a person reading
  bare columns of a training log reads the loss beside the step); slots that do not vary
  (``cuda:0``) are the template's;
- a shape with no varying slot is no series, and so is one with words in it: YOLO's validation
  rows (``all 128 929 0.726 0.568``), a progress bar, a banner with a count are no loss. Only
  separators and the text of a tensor's repr may stand between the numbers, or one word that
  names a split, which names the series: build-nanogpt's ``log.txt`` rows ``76 train 7.33`` are
  the training loss, its ``0 val 10.93`` rows a held-out one (`SPLITS`).

Memory is bounded: `MAX_SHAPES` shapes are followed, `REPEATS` lines each until their slots are
known.
"""

from __future__ import annotations

import math
import re
from itertools import pairwise

from stabilizer.core.signals import LOSS

from .._shapes import NUM
from ..aliases import VAL_LOSS

__all__ = ["MAX_SHAPES", "REPEATS", "SPLITS", "Series", "Shapes"]

REPEATS = 3  # lines of one shape before it is read as a series
MAX_SHAPES = 256  # shapes followed at once; later new ones are not
_NUMBER = re.compile(r"(?<![\w.])" + NUM + r"(?![\w.])")  # a number that is a token of its own
_TENSOR = re.compile(r"tensor\(#(?:,[^()]*(?:\([^()]*\)[^()]*)*)?\)")  # a scalar tensor's repr
_SEPARATORS = " \t,;|[]"
SPLITS = {"train": LOSS, "training": LOSS, **dict.fromkeys(("val", "valid", "test"), VAL_LOSS)}
"""The one word bare columns may hold, and the key of the value it names."""

_Slots = tuple[int | None, tuple[int, ...], str]  # the step's slot, the values', the first's key
Series = tuple[int | None, dict[str, float]]
"""A line read by its shape: its step (None: numbered by its place), its values."""


class Shapes:
    """Follows the shapes of the lines no name reads, and reads those that repeat."""

    def __init__(self) -> None:
        self._rows: dict[str, list[list[float]]] = {}  # a shape's lines until it is known
        self._slots: dict[str, _Slots | None] = {}  # known shapes

    def read(self, line: str) -> list[Series]:
        """The records of a line no name reads: none until its shape has come `REPEATS` times,
        then the lines of the shape so far, then one a line (none for a shape that is no
        series)."""
        numbers = _NUMBER.findall(line)
        if not numbers:
            return []
        shape = _NUMBER.sub("#", line)
        words = _TENSOR.sub("", shape).replace("#", "").strip(_SEPARATORS)
        if words and words not in SPLITS:  # words: no bare series, but for a split's name
            return []
        row = [float(number.replace(",", "")) for number in numbers]
        if shape in self._slots:
            slots = self._slots[shape]
            return [] if slots is None else [_series(row, slots)]
        rows = self._rows.setdefault(shape, []) if len(self._rows) < MAX_SHAPES else None
        if rows is None:
            return []
        rows.append(row)
        if len(rows) < REPEATS:
            return []
        slots = self._slots[shape] = _slots(rows, SPLITS.get(words, LOSS))
        del self._rows[shape]
        return [] if slots is None else [_series(each, slots) for each in rows]


def _slots(rows: list[list[float]], key: str) -> _Slots | None:
    """The step slot (or None), the value slots of a shape's first lines and the key of the
    first (the loss, or a split's: `SPLITS`); None for a shape with no value slot."""
    columns = list(zip(*rows, strict=True))
    step = next((at for at, column in enumerate(columns) if _counts(column)), None)
    varying = tuple(
        at
        for at, column in enumerate(columns)
        if at != step and any(value != column[0] for value in column)  # (NaN varies)
    )
    return (step, varying, key) if varying else None


def _counts(column: tuple[float, ...]) -> bool:
    """Whether a slot's values are integers that rise line after line: a counter."""
    whole = all(math.isfinite(value) and value == int(value) for value in column)
    return whole and all(b > a for a, b in pairwise(column))


def _series(row: list[float], slots: _Slots) -> Series:
    """One line's record: its step, the loss (or a split's key) in its first value slot, the
    others by place."""
    step, varying, key = slots
    values = {key if n == 0 else f"column_{at + 1}": row[at] for n, at in enumerate(varying)}
    return (None if step is None else int(row[step])), values
