"""`CsvTableReader`: a CSV of any tool with a step or epoch column and loss-like columns.

Ultralytics' ``results.csv`` (YOLOv5/v8), Keras' ``CSVLogger``, a script's own ``log.csv``::

                      epoch,      train/box_loss,      train/cls_loss, ...,  lr/pg0
                          1,             1.2917,              2.6455, ...,  0.0033

Headers and values may be padded with blanks. The header is the first row of names only; it
holds a counter (``step``, ``global_step``, ``iteration``, ``iter``, ``steps``, else ``epoch``:
that order wins) and a name with ``loss`` in it. The counter is the step: a log that counts
epochs is reported in epochs. Names map through the shared aliases (`_keys`), so
``train/loss`` is the loss and ``val/loss`` none; a log without a loss column but with training
parts (``train/box_loss``, ``train/cls_loss``: no ``val``/``test``/``eval`` prefix) has their sum
as its loss, as YOLO adds them. Cells that are no number are left out; a row without a counter
is skipped. Lightning's ``metrics.csv`` (``step`` and ``epoch`` both) has a reader of its own.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from typing import IO, ClassVar

from stabilizer.core.records import StepRecord
from stabilizer.core.signals import LOSS

from ._keys import KeyMap
from ._lines import Segments, text_lines
from .base import BaseReader, Item

__all__ = ["CsvTableReader"]

_COUNTERS = ("step", "global_step", "iteration", "iter", "steps", "epoch")
_HELD_OUT = ("val", "valid", "test", "eval", "metrics")  # prefixes of parts that are no training


def _header(row: list[str]) -> list[str] | None:
    """The stripped names of a header row, or None: three names or more, a counter among them
    and a name that says loss, no cell a number."""
    names = [cell.strip() for cell in row]
    if len(names) < 3 or not any(name.lower() in _COUNTERS for name in names):
        return None
    if not any("loss" in name.lower() for name in names):
        return None
    return None if any(_number(name) is not None for name in names) else names


def _number(cell: str) -> float | None:
    try:
        return float(cell)
    except ValueError:
        return None


class CsvTableReader(BaseReader):
    """Reads a CSV of steps (or epochs) and losses (see the module docstring)."""

    format: ClassVar[str] = "csv"

    @classmethod
    def sniff(cls, head: list[str]) -> float:
        first = next((line for line in head if line.strip()), "")
        if first.count(",") < 2 or _header(first.split(",")) is None:
            return 0.0
        return 0.85

    def _items(self, stream: IO[bytes]) -> Iterator[Item]:
        keys, segments = KeyMap(), Segments()
        rows = csv.reader(text_lines(stream, self.notes))
        header: list[str] = []
        counter = 0
        try:
            for row in rows:
                found = _header(row)
                if found is not None:
                    header = found
                    lows = [name.lower() for name in header]
                    counter = lows.index(next(c for c in _COUNTERS if c in lows))
                    continue
                record = _record(header, counter, row, keys) if header else None
                if record is None:
                    continue
                restart = segments.restart(record.step, rows.line_num)
                if restart is not None:
                    yield restart
                yield record
        except csv.Error as exc:  # a row the csv module refuses: what came before stands
            self.note("truncated", f"stopped at a row that is not CSV ({exc})", rows.line_num)


def _record(header: list[str], counter: int, row: list[str], keys: KeyMap) -> StepRecord | None:
    """A row as a record at its counter's value, or None for a row without a counter."""
    if len(row) <= counter:
        return None
    step = _number(row[counter])
    if step is None or step != step or abs(step) > 2**62:
        return None
    raw = {}
    for index, (name, cell) in enumerate(zip(header, row, strict=False)):
        value = _number(cell) if index != counter and cell.strip() else None
        if value is not None and name.lower() not in _COUNTERS:
            raw[name] = value
    values = keys.values(raw)
    if LOSS not in values:
        parts = [v for k, v in values.items() if _training_part(k)]
        if parts:
            values[LOSS] = sum(parts)
    return StepRecord(int(step), values)


def _training_part(key: str) -> bool:
    """Whether a key is a part of the training loss: ``box_loss``, ``loss_cls``, not ``val/...``."""
    low = key.lower()
    if not (low.endswith("loss") or low.startswith("loss_")) or low == "val_loss":
        return False
    return low.split("/", 1)[0].split("_", 1)[0] not in _HELD_OUT
