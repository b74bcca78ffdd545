"""`FairseqReader`: fairseq's ``train_inner`` progress lines and its fp16 scaler messages.

Lines read (``--log-format simple`` and ``json``, with or without the hydra-era prefix)::

    2024-01-01 12:00:00 | INFO | train_inner | epoch 001:    100 / 1000 loss=9.123, nll_loss=9.0,
        ppl=512, wps=..., num_updates=100, lr=0.0005, gnorm=1.234, clip=0, loss_scale=128, ...
    2024-01-01 12:00:00 | INFO | train | epoch 001 | loss 9.123 | ... | num_updates 1000 | ...
    | epoch 048 | loss 3.633 | nll_loss 1.932 | ... | num_updates 17604 | ... | loss_scale 2.000
    2024-01-01 12:00:00 | INFO | fairseq.trainer | NOTE: gradient overflow detected, ignoring
        gradient, setting loss scale to: 32.0

The step is ``num_updates``; the loss is in base 2 (noted and kept); fields are interval
averages (an epoch's summary line: its means, at its last update). An overflow is a skipped
update at twice the scale announced; the minimum-scale error
ends the run. What the fields mean is written once: `_train`, `_valid` and `_scaler`. More:
docs/readers.md.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from typing import IO, Any, ClassVar

from stabilizer.core.records import StepRecord
from stabilizer.core.signals import CLIPPED, GRAD_NORM, LOSS, LOSS_SCALE, LR, SKIPPED

from ._lines import Segments, numbered_lines
from .base import BaseReader, Item
from .words import Told

__all__ = ["FairseqReader"]

_NUMBER = r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))"
_INNER = re.compile(r"\|\s*(?:train_inner\s*\|\s*|epoch \d+:\s*\d+\s*/\s*\d+\s)")
_KEYS = {  # train_inner names → keys; ``num_updates`` is the step
    "loss": LOSS,
    "nll_loss": "nll_loss",
    "lr": LR,
    "gnorm": GRAD_NORM,
    "clip": CLIPPED,
    "loss_scale": LOSS_SCALE,
}
_NAMES = ("num_updates", *_KEYS)
_SUMMARY = re.compile(r"\|\s*(?:train\s*\|\s*)?epoch \d+\s*\|(?!\s*valid)")  # an epoch's means
_VALID = re.compile(r"\|\s*valid\s*\|")
_VALID_PAIR = re.compile(r"\|\s*(\w+) ([^|\s]+)")
_OVERFLOW = re.compile(r"overflow detected.{0,80}?loss scale to:? ?" + _NUMBER)
_MINIMUM = re.compile(r"Minimum loss scale reached \(" + _NUMBER)
_STRONG = re.compile(
    r"\|\s*train_inner\s*\||\|\s*epoch \d+:\s*\d+\s*/\s*\d+\s+loss="
    r"|\|\s*epoch \d+\s*\|\s*loss \S+\s*\|\s*nll_loss "  # an epoch's summary, before hydra
)
_WEAK = re.compile(r"fairseq|\| INFO \| (?:train|valid) \|")
Parsed = tuple[int | None, dict[str, float]]  # (num_updates or None, values)


class FairseqReader(BaseReader):
    """Reads fairseq training logs (see the module docstring)."""

    format: ClassVar[str] = "fairseq"
    prefixed: ClassVar[bool] = True  # its lines are found with `search`

    @classmethod
    def sniff(cls, head: list[str]) -> float:
        if any(_STRONG.search(line) for line in head):
            return 0.95
        return 0.6 if any(_WEAK.search(line) for line in head) else 0.0

    def _items(self, stream: IO[bytes]) -> Iterator[Item]:
        segments, noted, inner, told = Segments(), False, False, Told()
        for lineno, line in numbered_lines(stream, self.notes):
            step, values = _parsed(line, summaries=not inner)
            inner = inner or (step is not None and _INNER.search(line) is not None)
            if step is None:
                if values:  # an overflow: the update that was tried is the next one
                    yield self._overflow(max(segments.last or 0, 0) + 1, values, lineno)
                    yield from told.said(line, max(segments.last or 0, 0) + 1)  # (the minimum)
                else:
                    segments.other(line)
                    yield from told.said(line, segments.last or 0)
                continue
            restart = segments.restart(step, lineno)
            if restart is not None:
                yield restart
            if not noted and LOSS in values:
                self.note("format", "fairseq losses are in base 2 (bits), interval means", lineno)
                noted = True
            yield StepRecord(step, values)

    def _overflow(self, step: int, values: dict[str, float], lineno: int) -> StepRecord:
        if values.pop("minimum", 0.0):
            self.note("format", "fairseq stopped: minimum loss scale reached", lineno)
        return StepRecord(step, values)


def _parsed(line: str, summaries: bool = True) -> Parsed:
    """``(num_updates, signal values)`` of a train_inner, epoch summary or valid line; an
    overflow's fields. An epoch's summary is read only with ``summaries`` (no train_inner line
    seen yet: its means over the epoch would repeat what those lines said, less sharply)."""
    found = _INNER.search(line)
    if found is None:
        scaler = _scaler(line)
        if scaler:
            return None, scaler
        summary = _SUMMARY.search(line) if "epoch" in line else None
        if summary is None:
            return _valid(line)
        return _train(dict(_VALID_PAIR.findall(line))) if summaries else (None, {})
    if line.startswith("{", found.end()):  # ``--log-format json``
        try:
            data = json.loads(line[found.end() :])
        except ValueError:
            return None, {}
        return _train(data) if isinstance(data, dict) else (None, {})
    return _train(_fields(line, found.end() - 1))


def _fields(line: str, start: int) -> dict[str, str]:
    """The ``name=value`` texts of a simple train_inner line from ``start``: each name's first
    `` name=`` (even inside another field's value), its value up to the next comma."""
    fields = {}
    for name in _NAMES:
        at = line.find(f" {name}=", start)
        if at >= 0:
            end = line.find(",", at)
            fields[name] = line[at + len(name) + 2 : end if end >= 0 else len(line)]
    return fields


def _train(fields: Mapping[str, Any]) -> Parsed:
    """What a train_inner line's ``name → value`` fields mean (texts, or JSON's values).

    The step is ``num_updates`` (no record without a finite one); the other names of `_KEYS` map
    to their keys (a value that is no number is left out), and ``clip``, the percentage of
    clipped updates in the interval, becomes ``clipped`` in 0..1.
    """
    try:
        updates = float(fields["num_updates"])
    except (KeyError, TypeError, ValueError):
        return None, {}
    if not math.isfinite(updates):
        return None, {}
    values = {}
    for name, key in _KEYS.items():
        try:
            values[key] = float(fields[name])
        except (KeyError, TypeError, ValueError):
            continue
    if CLIPPED in values:
        values[CLIPPED] /= 100.0
    return int(updates), values


def _valid(line: str) -> Parsed:
    """A valid line: ``(num_updates, {"val_loss": loss})``, or no record."""
    if not _VALID.search(line):
        return None, {}
    pairs = dict(_VALID_PAIR.findall(line))
    try:
        return int(pairs["num_updates"]), {"val_loss": float(pairs["loss"])}
    except (KeyError, ValueError):  # not both, or not numbers
        return None, {}


def _scaler(line: str) -> dict[str, float]:
    """The fields of an fp16 scaler message: an overflow skips the update, at the scale in force
    (twice the one announced: fairseq halves it); the minimum scale stops the run at that scale.
    Empty for any other line."""
    if "verflow" in line and (match := _OVERFLOW.search(line)):
        return {SKIPPED: 1.0, LOSS_SCALE: 2 * float(match.group(1))}
    if "Minimum loss scale" in line and (match := _MINIMUM.search(line)):
        return {SKIPPED: 1.0, LOSS_SCALE: float(match.group(1)), "minimum": 1.0}
    return {}
