"""`Watch`: follow running jobs' logs through the engines of `diagnose`, findings as they come.

Each path is followed (`follow`) in a thread of its own that reads it with the reader of its
format and puts the items on one bounded queue (`feed`); the caller's thread runs them through the
engines of `diagnose` (a fresh one per segment, split at the `Restart` items as there) and hands
each finding to ``on_finding`` as soon as it is found, as an `Alert`: a new episode, and every
update of one (a NaN that persists is an error, then the same episode escalated to critical,
then closed when the loss is finite again). The run ends when every
input has ended (a pipe closes) or `Watch.stop` is called (Ctrl-C: `Watch.run` stops on
`KeyboardInterrupt` too); then the engines close their open episodes (alerts only where the log
ended: a stopped watch did not see the run end), and `Watch.run` returns a `Diagnosis` per
path, as `diagnose` would for the same log.

A file's history (what it held when it was opened) is read first, so the detectors have their
baseline; its findings come as alerts with ``live`` False.

A folder follows its newest run's richest log (`stabilizer.replay.sources`). When the run gets
a richer log (the JSONL after the event file), that log's diagnosis replaces the other's, and
what was alerted already is not alerted again; when a new run starts below the folder, the run
followed so far is done (its diagnosis is one more outcome of the path) and the new one is
diagnosed from its start: a new run is never a restart of the last.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stabilizer.core.records import Finding

from .diagnose import Diagnosis, Failure, Located, _Diagnosing
from .feed import Detected, Ended, Switched, feed
from .follow import POLL
from .history import History
from .readers import LogReadError, Note
from .readers import unreadable_message as _unreadable

__all__ = ["QUEUE", "Alert", "Watch"]

QUEUE = 64
"""Batches waiting for the engines at most; a reader that is that far ahead waits."""

_EMPTY = "empty (nothing was written to it)"  # (as `diagnose` says of an empty pipe)


@dataclass(frozen=True)
class Alert:
    """A finding as `Watch` found it.

    Args:
        path: The path it was found in, as given.
        segment: The segment (1-based) of the log it is in.
        finding: The finding.
        live: False for a finding in what the file held when the watch began.
        wall: When it was found (``time.time()``).
        update: It updates an episode found before (escalates, grows or closes it).
        diagnosis: The diagnosis of the log so far (the run's facts, its other findings).
    """

    path: str
    segment: int
    finding: Finding
    live: bool
    wall: float
    update: bool = False
    diagnosis: Diagnosis | None = field(default=None, compare=False, repr=False)


class _Followed:
    """The engine side of one path: its diagnosis, once its format is known; the runs it
    followed before (a folder's); the alerts handed out for its run."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.replay: _Diagnosing | None = None
        self.failure: Failure | None = None
        self.head: list[str] = []
        self.live = False  # whether the items read now are past the file's history
        self.done: list[Diagnosis] = []  # the runs followed before this one
        self.replaced: Diagnosis | None = None  # the poorer log of this run, until this one reads
        self.said: set[tuple[Any, ...]] = set()  # the alerts handed out for this run

    def detected(self, item: Detected, bins: int) -> _Diagnosing:
        """A new diagnosis for the log ``item`` detected (a folder's: named by its file)."""
        name = item.file if item.file and Path(self.path).is_dir() else self.path
        diagnosis = Diagnosis(name, item.format, item.notes, history=History(bins))
        self.replay = _Diagnosing(diagnosis, ())
        return self.replay

    def switched(self, item: Switched) -> None:
        """The followed log changed: a new run (this one is done), or a richer log of it."""
        replay, self.replay, self.head = self.replay, None, []
        if replay is None or replay.segment is None:
            return
        replay.on_kept = None  # (its open episodes close in its report, not as alerts)
        replay.finish()
        replay.keep_live()
        if item.new_run:
            self.done.append(replay.diagnosis)
            self.said.clear()
            self.replaced = None
        else:
            self.replaced = replay.diagnosis

    def outcomes(self) -> list[Diagnosis | Failure]:
        """The diagnosis of each run followed, the last one's (or why it failed) last."""
        if self.replay is None or self.replay.segment is None:
            if self.replaced is not None:
                return [*self.done, self.replaced]
            if self.done and self.failure is None:  # a new run with no record yet
                return list(self.done)
            if self.failure is not None:
                return [*self.done, self.failure]
            fmt = self.replay.diagnosis.format if self.replay is not None else "generic"
            name = "standard input" if self.path == "-" else self.path
            why = _unreadable(name, self.head, fmt) if self.head else f"{name}: {_EMPTY}"
            return [*self.done, Failure(self.path, why)]
        return [*self.done, self.replay.diagnosis]


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
            threading.Thread(target=self._feed, args=(i,), daemon=True, name=f"watch-{i}")
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
        return [outcome for followed in self._followed for outcome in followed.outcomes()]

    def _take(self) -> int:
        """Handle the next message of a reader thread; 1 when it says its input ended."""
        try:
            index, item, live = self._queue.get(timeout=0.5)
        except queue.Empty:
            return 0
        followed = self._followed[index]
        if isinstance(item, Ended):
            self._end(followed)
            return 1
        if isinstance(item, Switched):
            followed.switched(item)
        elif isinstance(item, Detected):
            followed.head = item.head
            if item.format:
                replay = followed.detected(item, self.bins)
                replay.on_kept = lambda found, update: self._found(followed, found, update)
        elif isinstance(item, LogReadError):
            self._failed(followed, str(item))
        elif followed.replay is not None:
            followed.live = live
            for one in item:
                followed.replay.observe(one)
        return 0

    def _found(self, followed: _Followed, found: Located, update: bool) -> None:
        """A finding as the engine made it: a new episode, or an update of one."""
        diagnosis = followed.replay.diagnosis if followed.replay is not None else None
        one = found.finding
        said = (one.kind, one.step, one.end_step, one.severity, update)
        if said in followed.said:  # (the run's poorer log said it already)
            return
        followed.said.add(said)
        alert = Alert(
            followed.path, found.segment, found.finding, followed.live, time.time(), update,
            diagnosis,
        )  # fmt: skip
        self.on_finding(alert)

    def _failed(self, followed: _Followed, message: str) -> None:
        replay = followed.replay
        if replay is None or replay.segment is None:
            followed.failure = Failure(followed.path, message)
        else:  # a reader gave up part-way: what came before stays
            replay.diagnosis.notes.append(Note("truncated", f"stopped reading: {message}"))

    def _end(self, followed: _Followed) -> None:
        replay = followed.replay
        if replay is None or replay.segment is None:
            return
        followed.live = True
        if self._stop.is_set():  # stopped, not ended: "until the end of the log" is no news
            replay.on_kept = None  # (the summary has the episodes the engines close)
        replay.finish()  # the log ended: the episodes still open close, alerts too
        replay.keep_live()

    def _feed(self, index: int) -> None:
        """The thread that reads input ``index`` (`feed`)."""
        followed = self._followed[index]
        feed(
            index,
            followed.path,
            self.format,
            self._queue.put,
            stop=self._stop,
            tell=self.tell,
            poll=self.poll,
        )
