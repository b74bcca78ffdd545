"""`TensorBoardReader`: scalars of TensorBoard event files (``events.out.tfevents.*``).

Every scalar is read, none sampled (TensorBoard's ``EventAccumulator`` keeps 1000 per tag unless
told otherwise): old-style ``simple_value`` summaries (torch's and Lightning's ``SummaryWriter``,
our own ``stability/`` tags) and TF2-style tensor summaries of the ``scalars`` plugin
(``float_val``/``double_val`` or ``tensor_content``). Images, histograms and text are skipped.
Framing: `_tfrecord` (length CRCs checked; a truncated or corrupt record ends the file with a
note). Decoding: `_tfevent` (a fast path that skips protobuf objects for known layouts).

Scalars are grouped by step into records, tags mapped as in `_keys`. Events of one step may be
interleaved with those of nearby steps, so up to `WINDOW` steps are held open and the lowest is
emitted when a new one arrives (memory: `WINDOW` steps of scalars). A restart (the run resumed
from a checkpoint and writes its steps again) is told by the event order: an event for a step
below the last one emitted, or a tag again for an open step below the highest one (writers emit a
step's scalars together, so a step that has its tag already was complete). Then everything open is
emitted and a segment starts; both segments keep their records. A late event for the step just
emitted becomes a record of its own; a step seen first below the highest open one (a sparse log
resumed between its logged steps) stays in the window until a tag repeats. `merge_steps` merges
the records of several event files of one run by step; equal steps become one record, later
files winning.
"""

from __future__ import annotations

import heapq
import math
import struct
from collections.abc import Iterable, Iterator
from typing import IO, ClassVar

from stabilizer.core.records import StepRecord

from ._keys import KeyMap
from ._tfevent import HEAD, EventDecoder
from ._tfrecord import frames, header_ok
from .base import BaseReader, Note, record

__all__ = ["WINDOW", "TensorBoardReader", "merge_steps"]

WINDOW = 64  # steps held open for interleaved events


class TensorBoardReader(BaseReader):
    """Reads one event file (a binary format: it sniffs bytes, see `sniff_bytes`).

    Args:
        notes: A list to append notes to.
        verify: Check every record's data CRC too (pure Python: several times slower).
    """

    format: ClassVar[str] = "tensorboard"

    def __init__(self, notes: list[Note] | None = None, verify: bool = False) -> None:
        super().__init__(notes)
        self.verify = verify
        self._keys, self._decoder = KeyMap(), EventDecoder()
        self._open: dict[int, dict[str, float]] = {}  # open steps → tag → value
        self._ready: list[StepRecord] = []  # records to emit
        self._done: int | None = None  # last step emitted in this segment
        self._top, self._sorted = -math.inf, True  # highest open step; whether _open is sorted

    @classmethod
    def sniff_bytes(cls, head: bytes, name: str = "") -> float:
        """Confidence that a file is an event file, from its first bytes and its name."""
        return 1.0 if header_ok(head) else 0.9 if "tfevents" in name else 0.0

    def _records(self, stream: IO[bytes]) -> Iterator[StepRecord]:
        decoder, head, unpack = self._decoder, HEAD.match, struct.unpack_from
        singles, steps, open_steps, ready = decoder.singles, decoder.steps, self._open, self._ready
        for batch in frames(stream, self.notes, self.verify):
            for data in batch:  # the hot loop: one scalar per event, a known layout
                match = head(data)
                if match is not None and (tag := singles.get(data[match.end() : -4])):
                    step = steps.get(match.group(1))
                    if step is None:
                        step = decoder.step(match.group(1))
                    raw = open_steps.get(step)
                    if raw is None:
                        raw = self._new_step(step)
                    elif tag in raw and step < self._top:  # the step again: a restart
                        raw = self._restart(step)
                    raw[tag] = unpack("<f", data, len(data) - 4)[0]
                elif (decoded := decoder.decode(data, match)) is not None:
                    self._add(*decoded)
                if ready:
                    yield from ready
                    ready.clear()
        self._flush()
        yield from ready
        if decoder.damaged:
            self.note("skipped", f"{decoder.damaged} damaged event(s) did not parse: skipped")

    def _add(self, step: int, pairs: Iterable[tuple[str, float]]) -> None:
        raw, pairs = self._open.get(step), list(pairs)
        if raw is None:
            raw = self._new_step(step)
        elif step < self._top and any(tag in raw for tag, _ in pairs):
            raw = self._restart(step)
        raw.update(pairs)

    def _restart(self, step: int) -> dict[str, float]:
        """A scalar of open ``step`` again after higher steps: everything open is emitted."""
        top = int(self._top)
        self._flush()
        self._done = None
        self.restart(step, None, f"step went back from {top} to {step}")
        return self._new_step(step)

    def _new_step(self, step: int) -> dict[str, float]:
        """Open ``step``: emit the lowest open step past the window, or all on a restart."""
        if self._done is not None and step <= self._done:  # a late event, or a restart
            self._flush()
            if step < self._done:
                self.restart(step, None, f"step went back from {self._done} to {step}")
            self._done = None
        self._sorted, self._top = self._sorted and step > self._top, max(self._top, step)
        raw = self._open[step] = {}
        if len(self._open) > WINDOW:
            low = next(iter(self._open)) if self._sorted else min(self._open)
            self._ready.append(record(low, self._keys.values(self._open.pop(low))))
            self._done = low
        return raw

    def _flush(self) -> None:
        for step in sorted(self._open):
            self._ready.append(record(step, self._keys.values(self._open[step])))
            self._done = step
        self._open.clear()
        self._top, self._sorted = -math.inf, True


def merge_steps(streams: Iterable[Iterator[StepRecord]]) -> Iterator[StepRecord]:
    """Records of several event files merged by step; equal steps become one record."""
    current: StepRecord | None = None
    for rec in heapq.merge(*streams, key=lambda r: r.step):
        if current is not None and rec.step == current.step:
            current = record(rec.step, {**current.values, **rec.values})
            continue
        if current is not None:
            yield current
        current = rec
    if current is not None:
        yield current
