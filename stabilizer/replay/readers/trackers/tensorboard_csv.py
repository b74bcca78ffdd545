"""`TensorBoardCsvReader`: one scalar as TensorBoard's UI downloads it, as CSV or JSON.

The scalars dashboard's "Download data" links write one tag of one run (TensorBoard's
``plugins/scalar`` ``scalars_route`` with ``format=csv``; the JSON is the route's own answer)::

    Wall time,Step,Value                  [[1714557600.1, 1, 10.98], [1714557600.4, 2, 9.61]]
    1714557600.1,1,10.98

The tag is in the file's name only: ``run-<run>-tag-<tag>.csv`` (a ``/`` of the tag written
``_``: ``run-version_0-tag-train_loss.csv``), else the name is the tag; it maps to a signal key
as any structured log's names do (``train_loss`` is the loss, ``lr-AdamW`` the learning rate).
Event files hold every tag at once: read them where you have them.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import IO, ClassVar

from stabilizer.core.records import StepRecord

from .._keys import KeyMap
from .._lines import Segments, text_lines
from ..base import BaseReader, Item, LogReadError

__all__ = ["TensorBoardCsvReader", "tag_of"]

_HEADER = ["Wall time", "Step", "Value"]
_MAX_JSON = 1 << 28  # bytes of a JSON download read at most


def tag_of(name: str) -> str:
    """The tag of a downloaded file's name: ``run-<run>-tag-<tag>.csv`` → ``<tag>``."""
    stem = Path(name).name.removesuffix(".csv").removesuffix(".json")
    return stem.rpartition("-tag-")[2] or stem or "value"


class TensorBoardCsvReader(BaseReader):
    """Reads TensorBoard's CSV or JSON download of one scalar (see the module docstring)."""

    format: ClassVar[str] = "tensorboard_csv"

    @classmethod
    def sniff(cls, head: list[str]) -> float:
        first = next((line.strip() for line in head if line.strip()), "")
        if [cell.strip() for cell in first.split(",")] == _HEADER:
            return 0.95
        return 0.9 if first.startswith("[[") and _triple(first[1:].split("]", 1)[0]) else 0.0

    def _items(self, stream: IO[bytes]) -> Iterator[Item]:
        tag = tag_of(self.name) if self.name else "value"
        keys, segments = KeyMap(), Segments()
        self.note("format", f"a TensorBoard download of one tag, {tag!r} (from the file's name)")
        for line, step, value in self._points(stream):
            restart = segments.restart(step, line)
            if restart is not None:
                yield restart
            yield StepRecord(step, keys.values({tag: value}))

    def _points(self, stream: IO[bytes]) -> Iterator[tuple[int, int, float]]:
        """``(line, step, value)`` of each point, in file order."""
        peek = getattr(stream, "peek", None)
        if peek is not None and peek(64).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):
            yield from _json_points(stream)
            return
        rows = csv.reader(text_lines(stream, self.notes))
        try:
            for row in rows:
                point = _triple(",".join(row))
                if point is not None:
                    yield rows.line_num, point[0], point[1]
        except csv.Error as exc:
            self.note("truncated", f"stopped at a row that is not CSV ({exc})", rows.line_num)


def _triple(text: str) -> tuple[int, float] | None:
    """``wall time, step, value`` as ``(step, value)``; None when it is no such row."""
    cells = text.strip().lstrip("[").split(",")
    if len(cells) != 3:
        return None
    try:
        step, value = float(cells[1]), float(cells[2])
    except ValueError:
        return None
    if not math.isfinite(step) or abs(step) > 2**62:
        return None
    return int(step), value


def _json_points(stream: IO[bytes]) -> Iterator[tuple[int, int, float]]:
    data = stream.read(_MAX_JSON)
    try:
        points = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise LogReadError(f"not a TensorBoard JSON download ({exc})") from None
    for index, point in enumerate(points if isinstance(points, list) else [], 1):
        if isinstance(point, list) and len(point) == 3:
            found = _triple(",".join(map(str, point)))
            if found is not None:
                yield index, found[0], found[1]
