"""`MegatronReader`: the ``iteration N/ M | ... |`` lines of Megatron-LM (and Megatron-DeepSpeed).

A line (new layouts prefix a ``[2024-05-01 12:00:00]`` timestamp; old ones carry other fields)::

     iteration     1200/   50000 | consumed samples: ... | learning rate: 3.000E-04 | global
     batch size:   512 | lm loss: 3.141593E+00 | loss scale: 4096.0 | grad norm: 0.500 |
     number of skipped iterations:   0 | number of nan iterations:   0 |

The losses are averages over the log interval, so the record sits at the interval's last
iteration and a one-step spike is diluted (a note says so). What the fields mean is written
once, in `_values`. Early Megatron-LM printed no colons (``| lm loss 1.020020E+01 |``); a record
printed over several lines is one record. Under Megatron-DeepSpeed, DeepSpeed's scaler skips a
step with its own words (``[deepspeed] OVERFLOW! ... Skipping step``, ``Overflow detected.
Skipping step. Attempted loss scale: 1``) before the iteration's line, whose ``number of skipped
iterations`` does not count it: such a record is ``skipped`` 1. More: docs/readers.md.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import IO, ClassVar

from stabilizer.core.records import StepRecord
from stabilizer.core.signals import GRAD_NORM, LOSS, LOSS_SCALE, LR, SKIPPED, VOCAB_SIZE

from ._lines import IDLE, Segments, numbered_lines
from ._shapes import vocab_of
from .base import BaseReader, Item
from .words import Told, overflow_of

__all__ = ["MegatronReader"]

_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\|")
_KEYS = {  # the labels read → their keys
    "lm loss": LOSS,
    "loss scale": LOSS_SCALE,
    "grad norm": GRAD_NORM,
    "learning rate": LR,
    "number of skipped iterations": "skipped_iterations",
    "number of nan iterations": "nan_iterations",
    VOCAB_SIZE: VOCAB_SIZE,  # (``padded vocab (size: N)`` above, on the next record)
}
_SKIPPED_BY_SCALER = "deepspeed skipped"  # a field no line prints: DeepSpeed said it skipped
_WEAK = re.compile(r"- arguments -|> building \w+ model|using world size:|megatron", re.I)


def _values(fields: dict[str, str]) -> dict[str, float]:
    """What an iteration line's ``label → value text`` fields mean, as signal values.

    - The labels of `_KEYS` map to their keys (a value that is no number is left out).
    - An interval average that is NaN (or not positive) is left off the line by Megatron; the
      interval's ``number of nan iterations`` still counts it: nan iterations > 0 make the loss
      NaN.
    - Skipped iterations > 0 (the fp16 scaler, or the NaN skip, fired in the interval) make
      ``skipped`` 1, else 0; the two counts pass through as ``skipped_iterations`` and
      ``nan_iterations``.
    """
    values = {}
    for label, key in _KEYS.items():
        try:
            values[key] = float(fields[label])
        except (KeyError, ValueError):
            continue
    if values.get("nan_iterations", 0.0) > 0:
        values[LOSS] = math.nan
    if "skipped_iterations" in values:
        values[SKIPPED] = 1.0 if values["skipped_iterations"] > 0 else 0.0
    if _SKIPPED_BY_SCALER in fields:
        values[SKIPPED] = 1.0
    return values


def _fields(text: str) -> dict[str, str]:
    """The ``label → value text`` fields of ``| label: value |`` text (the value runs to the next
    ``|``), or of early Megatron's ``| label 1.0E-06 |`` (the last word is the value); of a label
    given twice, the first counts."""
    fields: dict[str, str] = {}
    for part in text.split("|"):
        label, colon, value = part.partition(":")
        if not colon:
            label, _, value = part.strip().rpartition(" ")
        label = label.strip()
        if label:
            fields.setdefault(label, value)
    return fields


def _more(fields: dict[str, str], line: str) -> bool:
    """Whether ``line`` goes on with the record of ``fields``: it gives labels of `_KEYS` the
    record lacks (then they are added)."""
    if ":" not in line:
        return False
    more = {k: v for k, v in _fields(line).items() if k.strip() in _KEYS}
    if not more or any(label in fields for label in more):
        return False
    fields.update(more)
    return True


class MegatronReader(BaseReader):
    """Reads Megatron-LM console logs; one record per logged interval (see the module doc)."""

    format: ClassVar[str] = "megatron"
    _interval = 0  # the log interval, once known
    _scaled = False  # whether a loss scale other than 1.0 was printed: an fp16 scaler
    _fixed = False  # whether the constant scale of 1.0 was noted
    _overflowed = False  # whether DeepSpeed said it skipped a step since the last record

    @classmethod
    def sniff(cls, head: list[str]) -> float:
        if any(_ITERATION.search(line) for line in head):
            return 1.0
        return 0.4 if any(_WEAK.search(line) for line in head) else 0.0

    def _items(self, stream: IO[bytes]) -> Iterator[Item]:
        segments, self._interval, self._scaled, self._fixed = Segments(), 0, False, False
        step, fields = 0, dict[str, str]()  # the record being read: its step and fields
        stated: float | None = None  # the vocabulary a line stated, for the next record
        told = Told()  # the trainer's words that report trouble ("Spiky loss"), said once
        self._overflowed = False
        for lineno, line in numbered_lines(stream, self.notes):
            if line is IDLE and fields:  # a followed log waits: the record is done
                yield self._record(step, fields)
                fields = {}
            match = _ITERATION.search(line) if "iteration" in line else None
            if match is None:
                if fields and _more(fields, line):  # the record goes on on this line
                    continue
                stated = vocab_of(line) or stated
                if fields:
                    yield self._record(step, fields)
                    fields = {}
                yield from self._other(line, step, segments, told)
                continue
            if fields:
                yield self._record(step, fields)
            step, last = int(match[1]), segments.last
            restart = segments.restart(step, lineno)
            if restart is not None:
                yield restart
            else:
                self._note_interval(last, step, lineno)
            fields = self._opened(line[match.end() :], match[1])
            if stated is not None:
                fields[VOCAB_SIZE], stated = str(stated), None
        if fields:
            yield self._record(step, fields)

    def _opened(self, text: str, iteration: str) -> dict[str, str]:
        """The fields of an iteration's line (after its count), with DeepSpeed's skip since the
        last record, if it said one (Megatron's own count of skipped iterations does not hold
        it)."""
        fields = _fields(text) or {"iteration": iteration}
        if self._overflowed:
            fields[_SKIPPED_BY_SCALER], self._overflowed = "1", False
        return fields

    def _other(self, line: str, step: int, segments: Segments, told: Told) -> Iterator[Item]:
        """A line that is no iteration's: a restart's banner, the trainer's words, DeepSpeed
        saying it skipped a step (the next iteration's)."""
        if "verflow" in line and overflow_of(line) is not None:
            self._overflowed = True
        segments.other(line)
        yield from told.said(line, step)

    def _record(self, step: int, fields: dict[str, str]) -> StepRecord:
        """The record of an interval's fields. A loss scale of 1.0 on every line so far is no
        fp16 scaler: Megatron prints 1.0 in bf16 and fp32, where skipped iterations are the
        run's own NaN skips, so it is left out (with a note) until it moves."""
        values = _values(fields)
        scale = values.get(LOSS_SCALE)
        if scale is not None and scale != 1.0:
            self._scaled = True
        elif scale is not None and not self._scaled:
            del values[LOSS_SCALE]
            if not self._fixed:
                self._fixed = True
                why = "loss scale 1.0 on every line: no fp16 scaler (bf16 or fp32)"
                self.note("no_fp16_scaler", why)
        return StepRecord(step, values)

    def _note_interval(self, last: int | None, step: int, lineno: int) -> None:
        """Note the log interval once: the steps between the first two records in a row."""
        if self._interval or last is None or not 0 <= last < step:
            return
        self._interval = interval = step - last
        self.note(
            "format",
            f"Megatron losses are averages over the log interval of {interval} iterations, "
            "each recorded at the interval's last iteration: short spikes are diluted",
            lineno,
        )
