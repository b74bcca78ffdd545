"""Growing logs as streams that wait for more: what `stabilizer watch` reads, like ``tail -F``.

A `FollowedFile` is a binary stream over one path whose ``read1`` returns what has been written
since the last read, waits (polling every `POLL` seconds) while nothing new is there, and returns
`IDLE_CHUNK` once after each burst of data, so that a reader hands out the record it holds back
(see `IDLE`). The readers of `diagnose` read it unchanged. It survives:

- a file that appears later, a run directory whose log appears later, or a run directory that
  appears later (all it holds is then new);
- rotation: the name now leads to another file (renamed away, a new one created): the old one is
  read to its end, then the new one from its start;
- a folder's run gets a richer log, or a new run starts below it (`stabilizer.replay.sources`):
  that is no rotation but a *switch* of source: the stream ends (``read1`` returns ``b""``)
  with `FollowedFile.switch` set, and the caller reads the new log with its own reader, from
  its start (an event file's half-written record never runs into a JSONL's first line);
- truncation: the file got shorter than what was read (``> log``): read again from its start;
- a partial last line: held until its end is written (`text_lines` holds it); where the file
  changes under it, a line break ends it, so it never runs into the next file's first line.

A `FollowedPipe` does the same for a pipe (``-``); it ends where the pipe does. Reading ends
when ``stop`` is set: ``read1`` then returns ``b""``, the end of the stream.
"""

from __future__ import annotations

import logging
import os
import select
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .readers import LogReadError
from .readers._lines import CHUNK, IDLE_CHUNK
from .sources import Choice, LogFile, RunFinder

__all__ = ["POLL", "FollowedFile", "FollowedPipe", "Resolver", "resolver"]

logger = logging.getLogger(__name__)

POLL = 0.1
"""Seconds between two looks at a log that has nothing new: half the latency budget of a
finding, and a few hundred microseconds of CPU a second."""

_RECHECK = 1.0  # seconds between two searches of a run directory for a newer log

Resolver = Callable[[], Choice | None]
"""The log a followed path leads to now (None: none yet)."""


def resolver(path: Path, format: str) -> Resolver:
    """What ``path`` leads to now: a file, itself; a folder (also one that appears after the
    watch began), the richest log of its newest run (`RunFinder`); None while there is none."""
    finder = RunFinder(path, format)

    def resolve() -> Choice | None:
        if path.is_dir():
            return finder.look()
        return Choice(LogFile(path, format, 0, 0.0)) if path.exists() else None

    return resolve


class _IdleOwed:
    """When to return `IDLE_CHUNK`: once after each burst of data, when it has gone quiet."""

    def __init__(self) -> None:
        self.owed = False  # data came since the last IDLE_CHUNK

    def due(self) -> bool:
        owed, self.owed = self.owed, False
        return owed


class FollowedFile:
    """``tail -F`` of one path, as a binary stream (see the module docstring).

    `live` turns True at the first read past what the first file held when it was opened:
    what was read before it is the log's history. `switch` is set when the path came to lead to
    another log that is no rotation of this one (see the module docstring); the stream has
    ended then.

    Args:
        path: The path given (a file, or a run directory), for messages.
        resolve: The log it leads to now (`resolver`).
        stop: Set it to end the stream.
        tell: Called with one line on what happened to the file (appeared, rotated, truncated).
        poll: Seconds between two looks when there is nothing new.
        fresh: All the log holds is new (a source switched to while watching): no history.
    """

    def __init__(
        self,
        path: str,
        resolve: Resolver,
        stop: threading.Event,
        tell: Callable[[str], None] = logger.info,
        poll: float = POLL,
        fresh: bool = False,
    ) -> None:
        self.path, self.resolve, self._stop, self._tell = path, resolve, stop, tell
        self._poll = poll
        self._fd: int | None = None
        self._file: str | None = None
        self.switch: Choice | None = None  # the log the path leads to now, when no rotation
        # The path led nowhere at first, or the log was switched to: all it gets is new.
        self._waited = fresh or resolve() is None
        self._id: tuple[int, int] | None = None  # (device, inode) of the open file
        self._opened = 0  # files opened
        self.position = 0  # in the open file
        self._history = 0  # bytes of history: the size of the first file when opened
        self.live = False
        self._ended = True  # whether the last byte handed out ends a line
        self._break = False  # a line break is owed before the next file's first byte
        self._idle = _IdleOwed()
        self._checked = -_RECHECK  # when the path was last resolved
        self._directory = Path(path).is_dir()  # searched every `_RECHECK` only (looked at again)

    @property
    def waiting(self) -> bool:
        """Whether the path has led to no log yet (then all it leads to later is new)."""
        return self._waited and not self._opened

    @property
    def appeared(self) -> bool:
        """Whether the path ever led to a file (a log it was opened on)."""
        return self._opened > 0

    @property
    def file(self) -> str | None:
        """The file read now (None before one was opened)."""
        return self._file

    def read1(self, size: int = -1) -> bytes:
        """What is new (up to ``size`` bytes), `IDLE_CHUNK`, or ``b""`` once ``stop`` is set."""
        size = CHUNK if size is None or size < 0 else size
        while not (self._stop.is_set() or self.switch):
            if not self.live and self._opened and self.position >= self._history:
                self.live = True
                where = "" if self._file == self.path else f" ({self._file})"
                self._tell(f"{self.path}{where}: at its end; following")
            data = self._take(size)
            if data:
                self._idle.owed = True
                return data
            if self._switched():
                continue
            if self._idle.due():
                return IDLE_CHUNK
            self._stop.wait(self._poll)
        return b""

    read = read1

    def close(self) -> None:
        """Close the file followed."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _take(self, size: int) -> bytes:
        if self._fd is None:
            return b""
        if self._break:
            self._break, self._ended = False, True
            return b"\n"
        if not self.live:  # history and what follows it: never in one read
            size = min(size, self._history - self.position)
        try:
            data = os.read(self._fd, size)
        except OSError as exc:
            self._tell(f"{self.path}: cannot read ({exc.strerror or exc}); waiting")
            self.close()
            return b""
        self.position += len(data)
        if data:
            self._ended = data.endswith((b"\n", b"\r"))
        return data

    def _switched(self) -> bool:
        """Look at the path again (every `POLL`; a run directory every `_RECHECK`): open the
        file that appeared, the new file of a rotation, or the truncated file from its start."""
        now = time.monotonic()
        if now - self._checked < (_RECHECK if self._directory else self._poll):
            return False
        self._checked = now
        if not self._opened:  # a path not there yet may appear as a run directory
            self._directory = os.path.isdir(self.path)
        choice = self.resolve()
        if choice is None:  # not there yet, or renamed away: the open file may still grow
            self._waited = self._waited or not self._opened
            return False
        target = choice.log.path
        if self._file is not None and str(target) != self._file:  # another log: no rotation
            why = "a new run" if choice.new_run else "a richer log of the run"
            self._tell(f"{self.path}: switching to {target} ({why})")
            self.switch = choice
            return False
        try:
            info = os.stat(target)
        except OSError:
            return False
        if self._fd is not None and (info.st_dev, info.st_ino) == self._id:
            if info.st_size >= self.position:
                return False
            self._tell(f"{self.path}: truncated; reading it again from its start")
            os.lseek(self._fd, 0, os.SEEK_SET)
            self.position, self._break, self._history = 0, not self._ended, 0
            return True
        return self._open(target, info.st_size)

    def _open(self, target: Path, size: int) -> bool:
        try:
            fd = os.open(target, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        except OSError as exc:
            self._tell(f"{self.path}: cannot open {target} ({exc.strerror or exc}); waiting")
            return False
        if self._fd is not None:
            self._tell(f"{self.path}: rotated; following the new file {target}")
            self._break = not self._ended
        self.close()
        info = os.fstat(fd)
        if not (stat.S_ISREG(info.st_mode) or stat.S_ISFIFO(info.st_mode)):
            os.close(fd)  # (/dev/zero would be read for ever)
            raise LogReadError(f"{target}: a device or a socket, not a log file")
        self._fd, self._file, self._id = fd, str(target), (info.st_dev, info.st_ino)
        self._history = 0 if self._opened or self._waited else size
        self._opened += 1
        self.position = 0
        return True


class FollowedPipe:
    """A pipe (``-``) as a binary stream that returns `IDLE_CHUNK` when it goes quiet.

    Args:
        fd: The pipe's file descriptor (standard input: 0).
        stop: Set it to end the stream.
        poll: Seconds to wait for data before looking at ``stop`` again.
    """

    live = True
    path = "-"

    def __init__(self, fd: int, stop: threading.Event, poll: float = POLL) -> None:
        self._fd, self._stop, self._poll = fd, stop, poll
        self._idle = _IdleOwed()
        self._done = False

    def read1(self, size: int = -1) -> bytes:
        """What came (up to ``size`` bytes), `IDLE_CHUNK`, or ``b""`` at the pipe's end."""
        size = CHUNK if size is None or size < 0 else size
        while not (self._done or self._stop.is_set()):
            if select.select([self._fd], [], [], self._poll)[0]:
                data = os.read(self._fd, size)
                self._done = not data
                self._idle.owed = bool(data)
                return data
            if self._idle.due():
                return IDLE_CHUNK
        return b""

    read = read1

    def close(self) -> None:
        """Standard input stays open."""
