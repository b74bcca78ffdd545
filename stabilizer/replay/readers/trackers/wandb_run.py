"""`WandbRunReader`: a W&B run's ``run-<id>.wandb`` file, what ``wandb.log`` wrote.

W&B keeps every run, online or offline, in ``wandb/run-*/`` or ``wandb/offline-run-*/`` (and
``wandb/latest-run``, a link to the newest): its ``run-<id>.wandb`` file holds everything the run
sent, as ``wandb_internal_pb2.Record`` protobufs in the LevelDB log format (`_leveldb`: every CRC
checked; a record cut short by a run still writing is where reading ends, or waits). W&B has no
local reader of its own (users asked since 2020: wandb#1308, #1768, #4635, #9448).

Each ``history`` record is one ``wandb.log`` call: its items (``nested_key`` or ``key``, a JSON
value, or a typed one) and W&B's ``_step``. Numbers are kept (``NaN`` and ``Infinity`` too);
media, tables and text are not. Rows become records as `TrackerRows` says: the step is the
trainer's (``trainer/global_step``, ``train/global_step``) where logged, else ``_step``. The run's
name and project come from its ``run`` record, in a note. ``files/wandb-summary.json`` holds the
last value of each metric: no curve, not read.

The protobuf classes are the ``wandb`` package's (``pip install 'stabilizer-lightning[wandb]'``);
without it, one line says so.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import ModuleType
from typing import IO, Any, ClassVar

from google.protobuf.message import DecodeError

from ..base import BaseReader, Item
from .leveldb import MAGIC, records
from .rows import TrackerRows, missing_extra, number

__all__ = ["WandbRunReader"]


def _protos() -> ModuleType:
    try:
        from wandb.proto import wandb_internal_pb2
    except ImportError:
        raise missing_extra("wandb", "a W&B run file (.wandb)") from None
    return wandb_internal_pb2


class WandbRunReader(BaseReader):
    """Reads a W&B ``run-*.wandb`` file (a binary format: it sniffs bytes, `sniff_bytes`)."""

    format: ClassVar[str] = "wandb"
    binary: ClassVar[bool] = True

    @classmethod
    def sniff_bytes(cls, head: bytes, name: str = "") -> float:
        """Confidence that a file is a W&B run file: its header."""
        return 1.0 if head.startswith(MAGIC) else 0.0

    def _items(self, stream: IO[bytes]) -> Iterator[Item]:
        pb = _protos()
        typed = "value" in pb.HistoryItem.DESCRIPTOR.oneofs_by_name  # wandb 0.2x: typed values
        rows = TrackerRows(self.note)
        damaged = 0
        for batch in records(stream, self.notes):
            if not batch:  # a followed file waits: the last step is complete
                yield from rows.flush()
            for data in batch:
                try:
                    record = pb.Record.FromString(data)
                except DecodeError:
                    damaged += 1
                    continue
                kind = record.WhichOneof("record_type")
                if kind == "history":
                    step = record.history.step.num if record.history.HasField("step") else None
                    yield from rows.add(step, _row(record.history.item, typed))
                elif kind == "run":
                    self._named(record.run)
        yield from rows.done()
        if damaged:
            self.note("skipped", f"{damaged} record(s) that are no W&B protobuf: skipped")

    def _named(self, run: Any) -> None:
        name = run.display_name or run.run_id
        where = f" of project {run.project}" if run.project else ""
        self.note("source", f"W&B run {name} ({run.run_id}){where}")


def _row(items: Any, typed: bool) -> dict[str, float]:
    """The numbers of a history record's items by name (``a/b`` for a nested key); ``typed``:
    the items may hold a typed value instead of JSON."""
    row: dict[str, float] = {}
    for item in items:
        name = "/".join(item.nested_key) if item.nested_key else item.key
        kind = item.WhichOneof("value") if typed else None
        if kind in ("number", "integer"):
            value: float | None = float(getattr(item, kind))
        elif item.value_json:
            value = _json_number(item.value_json)
        else:
            value = None
        if value is not None and name:
            row[name] = value
    return row


def _json_number(text: str) -> float | None:
    """A JSON value as a number (``NaN``, ``Infinity`` included), else None."""
    if len(text) > 64 or text[:1] in ("{", "["):  # media, tables, text: no number
        return None
    try:  # a JSON number (and NaN, Infinity) is Python's too: the JSON parser only for the rest
        return float(text)
    except ValueError:
        pass
    try:
        return number(json.loads(text))
    except (ValueError, RecursionError):
        return None
