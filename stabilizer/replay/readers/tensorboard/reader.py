"""`TensorBoardReader`: scalars of TensorBoard event files (``events.out.tfevents.*``).

Every scalar is read, none sampled: ``simple_value`` summaries and TF2 tensor scalars of the
``scalars`` plugin (framing: `frames`; decoding: `events`). Scalars are grouped by step into
records, tags mapped as in `_keys`; up to `WINDOW` steps are held open for interleaved events
(memory: `WINDOW` steps of scalars). A restart is told by the event stream, as TensorBoard's own
loader tells it: a ``session_log`` START after some records, an event for a step below the last
one emitted, or a tag again for an open step below the highest one; a `Restart` then comes before
the next record. `merge_steps` merges several event files of one run by step. The rules in full:
docs/readers.md.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Iterator
from typing import IO, ClassVar

from google.protobuf.message import DecodeError
from tensorboard.compat.proto import event_pb2

from stabilizer.core.records import StepRecord

from .._keys import KeyMap
from ..base import BaseReader, Item, Note, Restart
from .events import HEAD, EventDecoder
from .frames import frames, header_ok

__all__ = ["WINDOW", "TensorBoardReader", "merge_steps"]

WINDOW = 64  # steps held open for interleaved events


class TensorBoardReader(BaseReader):
    """Reads one event file (a binary format: it sniffs bytes, see `sniff_bytes`).

    Args:
        notes: A list to append notes to.
        verify: Check every record's data CRC too (pure Python: several times slower).
    """

    format: ClassVar[str] = "tensorboard"
    binary: ClassVar[bool] = True

    def __init__(self, notes: list[Note] | None = None, verify: bool = False) -> None:
        super().__init__(notes)
        self.verify = verify
        self._keys = KeyMap()
        self._open: dict[int, dict[str, float]] = {}  # open steps → tag → value
        self._ready: list[Item] = []  # items to hand out
        self._done: int | None = None  # last step emitted in this segment
        self._top = -math.inf  # the highest open step
        self._restart = ""  # why the run restarted, before the next record emitted

    @classmethod
    def sniff_bytes(cls, head: bytes, name: str = "") -> float:
        """Confidence that a file is an event file, from its first bytes and its name."""
        return 1.0 if header_ok(head) else 0.9 if "tfevents" in name else 0.0

    def _items(self, stream: IO[bytes]) -> Iterator[Item]:
        decoder = EventDecoder()
        for batch in frames(stream, self.notes, self.verify):
            if not batch:  # a followed file waits (`IDLE_CHUNK`): the open steps are done
                self._flush()
                yield from self._ready
                self._ready.clear()
            for data in batch:
                match = HEAD.match(data)  # an event with a summary
                decoded = decoder.decode(data, match)
                if decoded is not None:
                    self._add(*decoded)
                elif match is None and _is_session_start(data):
                    self._session_start()
                if self._ready:
                    yield from self._ready
                    self._ready.clear()
        self._flush()
        yield from self._ready
        if decoder.damaged:
            self.note("skipped", f"{decoder.damaged} damaged event(s) did not parse: skipped")

    def _add(self, step: int, pairs: Iterable[tuple[str, float]]) -> None:
        raw, pairs = self._open.get(step), list(pairs)
        if raw is None:
            raw = self._new_step(step)
        elif step < self._top and any(tag in raw for tag, _ in pairs):
            # A scalar of open ``step`` again after higher steps: everything open is emitted.
            why = f"step went back from {int(self._top)} to {step}"
            self._flush()
            self._done, self._restart = None, why
            raw = self._new_step(step)
        raw.update(pairs)

    def _session_start(self) -> None:
        """A ``session_log`` START: the run started again; what is open is the old segment's."""
        if self._open or self._done is not None:  # (a run's first session is no restart)
            self._flush()
            self._done, self._restart = None, "a new session started (session_log START)"

    def _new_step(self, step: int) -> dict[str, float]:
        """Open ``step``: emit the lowest open step past the window, or all on a restart."""
        if self._done is not None and step <= self._done:  # a late event, or a restart
            last = int(max(self._top, self._done))  # the highest step seen
            restarted = step < self._done
            self._flush()
            if restarted:
                self._restart = f"step went back from {last} to {step}"
            self._done = None
        self._top = max(self._top, step)
        raw = self._open[step] = {}
        if len(self._open) > WINDOW:
            self._emit(min(self._open))
        return raw

    def _flush(self) -> None:
        for step in sorted(self._open):
            self._emit(step)
        self._top = -math.inf

    def _emit(self, step: int) -> None:
        """Hand out open ``step`` as a record (after the `Restart` before it, if any)."""
        if self._restart:
            self._ready.append(Restart(step, None, self._restart))
            self._restart = ""
        self._ready.append(StepRecord(step, self._keys.values(self._open.pop(step))))
        self._done = step


def _is_session_start(data: bytes) -> bool:
    """Whether an event is a ``session_log`` START (the run started again)."""
    try:
        event = event_pb2.Event.FromString(data)
    except DecodeError:
        return False
    return bool(
        event.HasField("session_log") and event.session_log.status == event.session_log.START
    )


def merge_steps(streams: Iterable[Iterator[Item]]) -> Iterator[Item]:
    """The records of several event files of one run merged by step; equal steps become one
    record (later files win). Where the merged steps go back (a file that restarted within
    itself), a `Restart`."""
    records = (_records_of(stream) for stream in streams)
    current: StepRecord | None = None
    for rec in heapq.merge(*records, key=lambda r: r.step):
        if current is not None and rec.step == current.step:
            current = StepRecord(rec.step, {**current.values, **rec.values})
            continue
        if current is not None:
            yield current
            if rec.step < current.step:
                yield Restart(rec.step, None, f"step went back from {current.step} to {rec.step}")
        current = rec
    if current is not None:
        yield current


def _records_of(items: Iterator[Item]) -> Iterator[StepRecord]:
    return (item for item in items if isinstance(item, StepRecord))
