"""`MegatronReader`: the ``iteration N/ M | ... |`` lines of Megatron-LM (and Megatron-DeepSpeed).

A line (new layouts prefix a ``[2024-05-01 12:00:00]`` timestamp; old ones carry other fields)::

     iteration     1200/   50000 | consumed samples: ... | learning rate: 3.000E-04 | global
     batch size:   512 | lm loss: 3.141593E+00 | loss scale: 4096.0 | grad norm: 0.500 |
     number of skipped iterations:   0 | number of nan iterations:   0 |

Quirks: the losses are averages over the log interval (default 100 iterations), so the record
sits at the interval's last iteration and a one-step spike is diluted; the grad norm is the last
iteration's. An average that is NaN (or not positive) is left off the line; the interval's
``number of nan iterations`` still counts it, so nan iterations > 0 make the loss NaN.
Skipped iterations > 0 make ``skipped`` 1 (the fp16 scaler, or the NaN skip, fired in the
interval); the counts themselves pass through as ``skipped_iterations`` and ``nan_iterations``.

The fast path: a log repeats one layout, the same labels in the same order. The reader learns it
from an iteration line read the general way and compiles a bytes pattern of the literal labels
(`_Layout`); `Scan` matches it over whole chunks, and lines that do not match (noise, a restarted
run's other layout) come back as text for the general way, which learns the new layout.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import IO, Any, ClassVar

from stabilizer.core.records import StepRecord
from stabilizer.core.signals import GRAD_NORM, LOSS, LOSS_SCALE, LR, SKIPPED

from ._fields import Floats, Rows, Scan, column, line_pattern, stretches
from ._lines import resume_banner
from .base import BaseReader, record

__all__ = ["MegatronReader"]

# ``\biteration`` as a lookbehind after the literal: the same matches, found by a fast scan.
_ITERATION = re.compile(r"iteration(?<!\witeration)\s+(\d+)\s*/\s*\d+\s*\|")
_LABELED = re.compile(  # a wanted "| label: value" field; the value runs to the next "|"
    r"\| (lm loss|loss scale|grad norm|learning rate|number of skipped iterations|"
    r"number of nan iterations):([^|]*)"
)
_KEYS = (  # label → key, in the order of the record's keys
    ("lm loss", LOSS),
    ("loss scale", LOSS_SCALE),
    ("grad norm", GRAD_NORM),
    ("learning rate", LR),
    ("number of skipped iterations", "skipped_iterations"),
    ("number of nan iterations", "nan_iterations"),
)
_USUAL = ("learning rate", "lm loss", "loss scale", "grad norm", *(k for k, _ in _KEYS[4:]))
# The labels of `_KEYS`, common prefixes factored out: sre tries alternatives one by one.
_WANTED = "(?:l(?:m loss|oss scale|earning rate)|grad norm|number of (?:skipped|nan) iterations):"
# Fields that are none of the wanted ones (possessive: a field given back is no wanted one either).
_OTHERS = rf"(?:\|(?! {_WANTED})[^|]*+)*+"
_USUAL_LINE = re.compile(  # the wanted fields in the usual order, other fields around them
    "".join(rf"{_OTHERS}\| {label}:([^|]*)" for label in _USUAL)
)
# The usual line whole from its start: no "i" before its first "iteration" (so `_ITERATION` would
# find this one), the step, then `_USUAL_LINE`.
_USUAL_START = re.compile(
    r"[^|i]*iteration(?<!\witeration)\s+(\d+)\s*/\s*\d+\s*" + _USUAL_LINE.pattern
)
_HEAD = re.compile(r"[^|i]*iteration(?<!\witeration)\s+\d+\s*/\s*\d+\s*(?=\|)")
_LABELS = {f" {label}:": label for label, _ in _KEYS}  # a wanted field's label → its label
_PLAIN_LINE = re.compile(r"[\t -~]*")
_WEAK = re.compile(r"- arguments -|> building \w+ model|using world size:|megatron", re.I)


class MegatronReader(BaseReader):
    """Reads Megatron-LM console logs; one record per logged interval (see the module doc)."""

    format: ClassVar[str] = "megatron"

    @classmethod
    def sniff(cls, head: list[str]) -> float:
        if any(_ITERATION.search(line) and "|" in line for line in head):
            return 1.0
        return 0.4 if any(_WEAK.search(line) for line in head) else 0.0

    def _records(self, stream: IO[bytes]) -> Iterator[StepRecord]:
        state = -1, "", 0, 0  # last step, pending banner, log interval, line number
        scan = Scan(stream, self.notes)
        self._layout = _Layout((), usual=False)  # none learned yet
        self._get = Floats().__getitem__
        for item in scan:
            if isinstance(item, list):
                state = yield from self._general(item, scan, state)
                continue
            layout: _Layout = item.pattern  # type: ignore[assignment]  # (a line of a learned layout)
            batch = layout.batch(item.rows, self._get)
            if batch is None:  # some line to read on its own
                state = yield from self._rows(item, layout, scan, state)
            else:
                state = yield from self._batch(*batch, state)

    def _batch(
        self, steps: list[int], values: list[dict[str, float]], state: tuple[int, str, int, int]
    ) -> Generator[StepRecord, None, tuple[int, str, int, int]]:
        """`_rows` of a run's steps and values (`_Layout.batch`): records one by one while there
        is something to note (a restart, the interval: each note just before its record, as the
        report expects), then the rest of a stretch at once. Returns the state."""
        last, banner, interval, lineno = state
        for start, end in stretches(steps):
            at = start
            while at < end and (steps[at] < last or banner or not interval):
                step, lineno = steps[at], lineno + 1
                interval = self._placed(step, last, banner, interval, lineno)
                banner, last = "", step
                yield record(step, values[at])
                at += 1
            if at < end:
                lineno, last = lineno + end - at, steps[end - 1]
                yield from list(map(record, steps[at:end], values[at:end]))
        return last, banner, interval, lineno

    def _rows(
        self, rows: Rows, layout: _Layout, scan: Scan, state: tuple[int, str, int, int]
    ) -> Generator[StepRecord, None, tuple[int, str, int, int]]:
        """`_records` of lines of ``layout``, one by one; returns the state."""
        last, banner, interval, lineno = state
        for index, texts in enumerate(rows.rows):
            values = layout.values(texts, self._get)
            if values is None:  # some value no number: the general way
                line = rows.line(index)
                state = last, banner, interval, lineno
                last, banner, interval, lineno = yield from self._general([line], scan, state)
                continue
            lineno += 1
            step = int(texts[0])
            if step < last or banner or not interval:
                interval = self._placed(step, last, banner, interval, lineno)
                banner = ""
            last = step
            yield record(step, values)
        return last, banner, interval, lineno

    def _general(
        self, lines: list[str], scan: Scan, state: tuple[int, str, int, int]
    ) -> Generator[StepRecord, None, tuple[int, str, int, int]]:
        """`_records` of lines read the general way; learns their layout. Returns the state."""
        last, banner, interval, lineno = state
        for line in lines:
            lineno += 1
            found = _step_values(line)
            if found is None:
                if last >= 0 and not banner:
                    banner = resume_banner(line)
                continue
            learned = _Layout.of(line)
            if learned is not None and learned is not self._layout:
                self._layout = scan.pattern = learned
            step, values = found
            if step < last or banner or not interval:
                interval = self._placed(step, last, banner, interval, lineno)
                banner = ""
            last = step
            yield record(step, values)
        return last, banner, interval, lineno

    def _placed(self, step: int, last: int, banner: str, interval: int, lineno: int) -> int:
        """Note a restart before ``step``, or the log interval; the interval (0: not yet known)."""
        if step < last or banner:
            self.segment(step, last, banner, lineno)
        elif not interval and 0 <= last < step:
            interval = step - last
            self._note_interval(interval, lineno)
        return interval

    def _note_interval(self, interval: int, lineno: int) -> None:
        self.note(
            "format",
            f"Megatron losses are averages over the log interval of {interval} iterations, "
            "each recorded at the interval's last iteration: short spikes are diluted",
            lineno,
        )


def _step_values(line: str) -> tuple[int, dict[str, float]] | None:
    """The step and values of an iteration line; None for any other line."""
    usual = _USUAL_START.match(line)
    if usual is not None:
        values = _usual_values(usual.groups()[1:])
        if values is not None:
            return int(usual[1]), values
    match = _ITERATION.search(line)
    return None if match is None else (int(match[1]), _values(line, match.end() - 1))


def _values(line: str, start: int) -> dict[str, float]:
    """The values of the fields after ``start``; of a label given twice, the first counts."""
    usual = _USUAL_LINE.match(line, start)
    values = None if usual is None else _usual_values(usual.groups())
    return _any_values(_LABELED.findall(line, start)) if values is None else values


def _usual_values(
    texts: Sequence[str] | Sequence[bytes], floats: Callable[[Any], float] = float
) -> dict[str, float] | None:
    """The values of the `_USUAL` fields' texts (converted by ``floats``); None unless all are
    numbers."""
    try:
        lr, loss, scale, norm, skips, nans = map(floats, texts)
    except ValueError:
        return None
    return {
        LOSS: math.nan if nans > 0 else loss,
        LOSS_SCALE: scale,
        GRAD_NORM: norm,
        LR: lr,
        "skipped_iterations": skips,
        "nan_iterations": nans,
        SKIPPED: 1.0 if skips > 0 else 0.0,
    }


def _any_values(pairs: Sequence[tuple[str, str | bytes]]) -> dict[str, float]:
    """`_values` of any line: its wanted ``(label, value text)`` pairs, in line order."""
    values, found = {}, dict(pairs[::-1])
    for label, key in _KEYS:
        try:
            values[key] = float(found[label])
        except (KeyError, ValueError):
            continue
    if values.get("nan_iterations", 0.0) > 0:
        values[LOSS] = math.nan
    skipped = values.get("skipped_iterations")
    if skipped is not None:
        values[SKIPPED] = 1.0 if skipped > 0 else 0.0
    return values


class _Layout:
    """The labels of an iteration line, in order, as a pattern `Scan` matches over bytes.

    The pattern is `_USUAL_START`'s beginning (on a plain line), then each field of the line:
    ``|``, its label (its text up to its first colon; a field without one, whole) and, after a
    colon, any value (no ``|``). The first value of each wanted label is captured. Whether the
    general way reads a line through `_USUAL_START` depends on its labels alone (the first six
    wanted ones in `_USUAL` order: ``usual``); if not, `_any_values` takes each wanted label's
    first value too (of the captured ``labels``). So a match gives what `_step_values` gives.
    The pattern is a `line_pattern`: `Scan` hands out the groups of a run of lines of the layout
    at once (`Rows`, with this layout as their ``pattern``: `findall` is the pattern's); other
    lines come as text, for the general way, which learns a new layout from its first line.
    """

    __slots__ = ("findall", "labels", "pattern", "usual")

    def __init__(self, labels: tuple[str, ...], usual: bool | None = None) -> None:
        value = rb"[\t -{}~]*"  # a plain byte but "|"
        parts = [rb"^[\t -hj-{}~]*iteration(?<![0-9A-Za-z_]iteration)[\t ]+([0-9]+)[\t ]*/"]
        parts.append(rb"[\t ]*[0-9]+[\t ]*")
        wanted = [key for key in map(_LABELS.get, labels) if key is not None]
        captured: list[str] = []
        for label in labels:
            parts.append(rb"\|" + re.escape(label.encode()))
            key = _LABELS.get(label)
            if key is not None and key not in captured:
                captured.append(key)
                parts.append(b"(" + value + b")")
            elif label.endswith(":"):
                parts.append(value)
        parts.append(rb"\r?\n")
        self.pattern = line_pattern(b"".join(parts))
        self.findall = self.pattern.findall
        self.usual = tuple(wanted[:6]) == _USUAL if usual is None else usual
        self.labels = tuple(captured)

    def values(
        self, texts: tuple[bytes, ...], floats: Callable[[bytes], float]
    ) -> dict[str, float] | None:
        """The values of a line's groups (``texts``); None where the general way must read it."""
        if not self.usual:
            return _any_values(list(zip(self.labels, texts[1:-1], strict=True)))
        return _usual_values(texts[1:-1], floats)  # None for a value that is no number

    def batch(
        self, rows: list[tuple[bytes, ...]], floats: Callable[[bytes], float]
    ) -> tuple[list[int], list[dict[str, float]]] | None:
        """The steps and `values` of lines' groups (``rows``), converted column by column (C loops,
        no call per line; see `column`). None where a line must be read on its own (a layout not
        usual, a value no number). The loss goes through `float`: a memo (``floats``) would miss."""
        if not self.usual:
            return None
        steps, lr, loss, scale, norm, skipped, nan, _ = zip(*rows, strict=True)  # `_USUAL` order
        try:
            losses = list(map(float, loss))
            lrs, scales, norms, skips, nans = (
                column(texts, floats) for texts in (lr, scale, norm, skipped, nan)
            )
        except ValueError:
            return None
        values = [  # as `_usual_values`
            {
                LOSS: math.nan if nan > 0 else loss,
                LOSS_SCALE: scale,
                GRAD_NORM: norm,
                LR: lr,
                "skipped_iterations": skip,
                "nan_iterations": nan,
                SKIPPED: 1.0 if skip > 0 else 0.0,
            }
            for lr, loss, scale, norm, skip, nan in zip(
                lrs, losses, scales, norms, skips, nans, strict=True
            )
        ]
        return list(map(int, steps)), values

    @staticmethod
    def of(line: str) -> _Layout | None:
        """The layout of an iteration line; None for a line that is not plain."""
        head = _HEAD.match(line)
        if head is None or not _PLAIN_LINE.fullmatch(line):
            return None
        fields = line[head.end() + 1 :].split("|")
        return _layout(tuple(field[: field.find(":") + 1] or field for field in fields))


@functools.lru_cache(maxsize=16)
def _layout(labels: tuple[str, ...]) -> _Layout:
    """The `_Layout` of ``labels``, kept for the next lines (and a layout changing back)."""
    return _Layout(labels)
