"""`LightningCsvReader`: the ``metrics.csv`` of Lightning's ``CSVLogger``.

The header holds ``epoch``, ``step`` and one column per logged name; rows are sparse: the train
metrics of a step and its validation metrics are separate rows with empty cells elsewhere. Rows of
the same step next to each other merge into one record (later cells win). Column names map
through the shared aliases (``train_loss_step`` → ``loss``, ``lr-AdamW`` → ``lr``,
``grad_2.0_norm/<param>`` → per-group norms, ``stability/<key>`` → ``<key>``); the rest pass
through. A repeated header (two files concatenated) starts over with the new columns.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from typing import IO, ClassVar

from stabilizer.core.records import StepRecord

from ._keys import SET, KeyMap
from ._lines import text_lines
from .base import BaseReader, record

__all__ = ["LightningCsvReader"]


class LightningCsvReader(BaseReader):
    """Reads a Lightning ``metrics.csv`` (see the module docstring)."""

    format: ClassVar[str] = "lightning_csv"

    @classmethod
    def sniff(cls, head: list[str]) -> float:
        first = next((line for line in head if line.strip()), "")
        cells = [cell.strip().strip('"') for cell in first.split(",")]
        if "step" not in cells or len(cells) < 2:
            return 0.0
        return 0.95 if "epoch" in cells else 0.8

    def _records(self, stream: IO[bytes]) -> Iterator[StepRecord]:
        keys, rows, lineno = KeyMap(), csv.reader(text_lines(stream, self.notes)), 0
        plan, index, direct = [], -1, None  # type: list[tuple[int, str]], int, Direct
        step, raw, last = None, {}, -1  # type: int | None, dict[str, float], int
        while True:
            try:
                for row in rows:  # a csv.Error ends this loop; the next row starts a new one
                    lineno += 1
                    if "step" in row:  # a header: the columns to read, by index
                        raw = raw if step is None else _by_name(raw, direct)
                        index, plan, direct = _header(row, keys, step is None)
                        continue
                    try:
                        new = int(float(row[index])) if index >= 0 else None
                        cells = {name: float(row[i]) for i, name in plan if i < len(row) and row[i]}
                    except (ValueError, IndexError, OverflowError):
                        continue
                    if new is None or new == step:
                        raw.update(cells)
                        continue
                    if step is not None:
                        yield record(step, _mapped(raw, direct, keys))
                    if new < last:
                        self.segment(new, last, "", lineno)
                    step, raw, last = new, cells, new
                break
            except csv.Error as exc:  # a row the csv module refuses (a cell over its limit)
                lineno += 1
                self.note("skipped", f"a row is not CSV ({exc}): skipped", rows.line_num)
        if step is not None:
            yield record(step, _mapped(raw, direct, keys))


Direct = dict[str, str] | None  # signal key → column name, when cells land on keys directly


def _header(row: list[str], keys: KeyMap, fresh: bool) -> tuple[int, list[tuple[int, str]], Direct]:
    """The step column, the columns to read and what to call their values, from a header.

    When ``fresh`` (no step pending) and every column lands as it is on a key of its own
    (`KeyMap.lookup`), the cells are read straight into signal keys: the same values as mapping
    each step's names later, without the mapping. Else they are read by name.
    """
    plan = [(i, name) for i, name in enumerate(row) if name not in ("step", "epoch")]
    found = [(i, name, keys.lookup(name)) for i, name in plan]
    kept = [(i, name, f[0]) for i, name, f in found if f is not None]
    direct = {key: name for _, name, key in kept}
    alone = len(direct) == len(kept) and all(f is None or f[1] == SET for _, _, f in found)
    if fresh and alone:
        return row.index("step"), [(i, key) for i, _, key in kept], direct
    return row.index("step"), plan, None


def _mapped(raw: dict[str, float], direct: Direct, keys: KeyMap) -> dict[str, float]:
    """The signal values of a step's ``raw`` cells (by key already when ``direct``)."""
    return raw if direct is not None else keys.values(raw)


def _by_name(raw: dict[str, float], direct: Direct) -> dict[str, float]:
    """``raw`` by column name (it is by signal key when ``direct``): a new header came with a
    step pending, and is read by name (see `_header`)."""
    return raw if direct is None else {direct[key]: value for key, value in raw.items()}
