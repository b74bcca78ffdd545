"""`Watch`: follow running jobs' logs through the engines of `diagnose`, findings as they come.

Each path is followed (`follow`) in a thread of its own that reads it with the reader of its
format and puts the items on one bounded queue; the caller's thread runs them through the
engines of `diagnose` (a fresh one per segment, split at the `Restart` items as there) and hands
each finding to ``on_finding`` as soon as it is found, as an `Alert`. The run ends when every
input has ended (a pipe closes) or `Watch.stop` is called (Ctrl-C: `Watch.run` stops on
`KeyboardInterrupt` too); then the engines close their open episodes, and `Watch.run` returns a
`Diagnosis` per path, as `diagnose` would for the same log.

A file's history (what it held when it was opened) is read first, so the detectors have their
baseline; its findings come as alerts with ``live`` False.
"""

from __future__ import annotations

import io
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stabilizer.core.records import Finding

from .diagnose import Diagnosis, Failure, _Replay
from .follow import POLL, FollowedFile, FollowedPipe, resolver
from .history import History
from .readers import READERS, LogReadError, Note, TensorBoardReader, detect_format
from .readers import unreadable_message as _unreadable
from .readers._lines import IDLE_CHUNK, text_lines
from .readers._source import HEAD, is_binary

__all__ = ["BATCH", "QUEUE", "Alert", "Watch"]

BATCH = 1000
"""Items a reader thread hands over at once at most (it hands over what it has at each read)."""

QUEUE = 64
"""Batches waiting for the engines at most; a reader that is that far ahead waits."""

logger = logging.getLogger(__name__)

_CONFIDENT = 0.4  # a sniff score that settles the format before `HEAD` bytes have come


@dataclass(frozen=True)
class _End:
    """An input ended; the monitor's own findings of a ``stability.jsonl`` come with it."""

    stored: list[Finding]


@dataclass(frozen=True)
class Alert:
    """A finding as `Watch` found it.

    Args:
        path: The path it was found in, as given.
        segment: The segment (1-based) of the log it is in.
        finding: The finding.
        live: False for a finding in what the file held when the watch began.
        wall: When it was found (``time.time()``).
    """

    path: str
    segment: int
    finding: Finding
    live: bool
    wall: float


class _Followed:
    """The engine side of one path: its diagnosis, once its format is known."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.notes: list[Note] = []
        self.replay: _Replay | None = None
        self.failure: Failure | None = None
        self.head: list[str] = []

    def outcome(self) -> Diagnosis | Failure:
        if self.replay is None or self.replay.segment is None:
            if self.failure is not None:
                return self.failure
            fmt = self.replay.diagnosis.format if self.replay is not None else "generic"
            name = "standard input" if self.path == "-" else self.path
            return Failure(self.path, _unreadable(name, self.head, fmt))
        return self.replay.diagnosis


class Watch:
    """Follows logs and runs them through the engines (see the module docstring).

    Args:
        paths: Log files, run directories, or ``-`` (standard input), each followed.
        on_finding: Called in the caller's thread with each finding, as it is found.
        format: A reader name, or ``"auto"`` to detect it from each log's first lines.
        tell: Called (from any thread) with one line on what happened to an input.
        poll: Seconds between two looks at an input with nothing new.
        bins: Bins of each log's history, as in `diagnose`.
    """

    def __init__(
        self,
        paths: Sequence[str],
        on_finding: Callable[[Alert], None],
        *,
        format: str = "auto",
        tell: Callable[[str], None] | None = None,
        poll: float = POLL,
        bins: int = 512,
    ) -> None:
        self.paths, self.on_finding, self.format = list(paths), on_finding, format
        self.tell = tell or (lambda line: None)
        self.poll, self.bins = poll, bins
        self._stop = threading.Event()
        self._queue: queue.Queue[tuple[int, Any, bool]] = queue.Queue(QUEUE)
        self._followed = [_Followed(path) for path in self.paths]

    def stop(self) -> None:
        """End the watch: the inputs end, the engines close their episodes, `run` returns."""
        self._stop.set()

    def run(self) -> list[Diagnosis | Failure]:
        """Follow every input until all have ended or `stop` (or Ctrl-C) came."""
        threads = [
            threading.Thread(target=self._read, args=(i,), daemon=True, name=f"watch-{i}")
            for i in range(len(self.paths))
        ]
        for thread in threads:
            thread.start()
        running = len(threads)
        while running:
            try:
                running -= self._take()
            except KeyboardInterrupt:
                self.stop()
        return [followed.outcome() for followed in self._followed]

    def _take(self) -> int:
        """Handle the next message of a reader thread; 1 when it says its input ended."""
        try:
            index, item, live = self._queue.get(timeout=0.5)
        except queue.Empty:
            return 0
        followed = self._followed[index]
        if isinstance(item, _End):
            self._end(followed, item.stored)
            return 1
        if isinstance(item, str):  # the format, once detected
            diagnosis = Diagnosis(followed.path, item, followed.notes, history=History(self.bins))
            followed.replay = _Replay(diagnosis, ())
        elif isinstance(item, LogReadError):
            self._failed(followed, str(item))
        elif followed.replay is not None:
            for one in item:
                self._observe(followed, followed.replay, one, live)
        return 0

    def _observe(self, followed: _Followed, replay: _Replay, item: Any, live: bool) -> None:
        findings = replay.diagnosis.findings
        before = len(findings)
        replay.observe(item)
        for located in findings[before:]:
            self.on_finding(
                Alert(followed.path, located.segment, located.finding, live, time.time())
            )

    def _failed(self, followed: _Followed, message: str) -> None:
        replay = followed.replay
        if replay is None or replay.segment is None:
            followed.failure = Failure(followed.path, message)
        else:  # a reader gave up part-way: what came before stays
            followed.notes.append(Note("truncated", f"stopped reading: {message}"))

    def _end(self, followed: _Followed, stored: list[Finding]) -> None:
        replay = followed.replay
        if replay is None or replay.segment is None:
            return
        findings = replay.diagnosis.findings
        before = len(findings)
        replay.finish()
        for located in findings[before:]:
            alert = Alert(followed.path, located.segment, located.finding, True, time.time())
            self.on_finding(alert)
        replay.keep_live(stored)

    # --- the reader threads --------------------------------------------------------------------

    def _read(self, index: int) -> None:
        path, put = self.paths[index], self._queue.put
        stored: list[Finding] = []
        try:
            source = self._source(path)
            try:
                fmt, stream = self._detect(source, index)
                if fmt:
                    put((index, fmt, False))
                    reader = READERS[fmt](self._followed[index].notes)
                    batch = stream.batch = _Batch(index, source, put)
                    for item in reader.read(stream):  # type: ignore[arg-type]
                        batch.add(item)
                    batch.hand_over()
                    stored = getattr(reader, "findings", [])
            finally:
                source.close()
        except LogReadError as exc:
            put((index, exc, True))
        except OSError as exc:
            put((index, LogReadError(f"{path}: cannot read ({exc.strerror or exc})"), True))
        except Exception as exc:  # never a traceback from a thread: one line, as for a reader
            logger.debug("watching %s failed", path, exc_info=True)
            put((index, LogReadError(f"{path}: cannot watch ({type(exc).__name__}: {exc})"), True))
        finally:
            put((index, _End(stored), True))

    def _source(self, path: str) -> FollowedFile | FollowedPipe:
        if path == "-":
            return FollowedPipe(sys.stdin.fileno(), self._stop, self.poll)
        if not Path(path).exists():
            self.tell(f"{path}: not there yet; waiting for it")
        resolve = resolver(Path(path), self.format)
        return FollowedFile(path, resolve, self._stop, self.tell, self.poll)

    def _detect(self, source: FollowedFile | FollowedPipe, index: int) -> tuple[str, _Prefixed]:
        """The format (``""`` when the input ended first) and a stream from the log's start."""
        head, ended = b"", False
        while self.format == "auto" and not _settled(head):
            more = source.read1(HEAD)
            if more is not IDLE_CHUNK and not more:
                ended = True
                break
            head += more
        stream = _Prefixed(head, source)
        if self.format != "auto":
            return self.format, stream
        lines = list(text_lines(io.BytesIO(head), []))
        self._followed[index].head = lines[:20]
        if not head or (ended and not lines):
            return "", stream
        if TensorBoardReader.sniff_bytes(head) > 0.5:
            return TensorBoardReader.format, stream
        if is_binary(head):
            raise LogReadError(f"{source.path}: binary data, neither a text log nor an event file")
        return detect_format(lines), stream


def _settled(head: bytes) -> bool:
    """Whether the first bytes of a log tell its format: enough of them, an event file's
    header, binary data, or lines that a reader is confident of."""
    if len(head) >= HEAD or TensorBoardReader.sniff_bytes(head) > 0.5 or is_binary(head):
        return bool(head)
    lines = [line for line in text_lines(io.BytesIO(head), []) if line.strip()]
    return any(cls.sniff(lines) >= _CONFIDENT for cls in READERS.values()) if lines else False


class _Batch:
    """The items a reader thread has read since its last read of the input: handed over
    together (one queue operation, not one per line) before the next read, which may wait."""

    def __init__(
        self, index: int, source: FollowedFile | FollowedPipe, put: Callable[[Any], None]
    ) -> None:
        self.index, self.source, self.put = index, source, put
        self.items: list[Any] = []

    def add(self, item: Any) -> None:
        self.items.append(item)
        if len(self.items) >= BATCH:
            self.hand_over()

    def hand_over(self) -> None:
        if self.items:  # `live` as it was when these were read
            self.put((self.index, self.items, self.source.live))
            self.items = []


class _Prefixed:
    """The bytes read for detection again, then the rest of the followed stream; before each
    read, the batch of items read so far is handed over."""

    def __init__(self, head: bytes, source: FollowedFile | FollowedPipe) -> None:
        self._head, self._source = head, source
        self.batch: _Batch | None = None

    def read1(self, size: int = -1) -> bytes:
        if self.batch is not None:
            self.batch.hand_over()
        if self._head:
            head, self._head = self._head, b""
            return head
        return self._source.read1(size)

    read = read1
