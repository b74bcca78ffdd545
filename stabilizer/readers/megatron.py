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
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import IO, ClassVar

from ..records import StepRecord
from ..signals import GRAD_NORM, LOSS, LOSS_SCALE, LR, SKIPPED
from ._lines import resume_banner, text_chunks
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
        last, banner, interval, base = -1, "", 0, 1
        for lines in text_chunks(stream, self.notes):
            for lineno, line in enumerate(lines, base):
                found = _step_values(line)
                if found is None:
                    if last >= 0 and not banner:
                        banner = resume_banner(line)
                    continue
                step, values = found
                if step < last or banner:
                    self.segment(step, last, banner, lineno)
                    banner = ""
                elif not interval and 0 <= last < step:
                    interval = step - last
                    self._note_interval(interval, lineno)
                last = step
                yield record(step, values)
            base += len(lines)

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


def _usual_values(texts: tuple[str, ...]) -> dict[str, float] | None:
    """The values of the `_USUAL` fields' texts; None unless all are numbers."""
    try:
        lr, loss, scale, norm, skips, nans = map(float, texts)
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


def _any_values(pairs: list[tuple[str, str]]) -> dict[str, float]:
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
