"""`feed`: one followed log read in a thread of its own, its items handed over in batches.

The thread opens the input (`follow`), waits for the first lines that tell its format (a line a
reader is confident of, an event file's header, or `HEAD` bytes), detects it as `read_log` does
(`detect_head`: a pasted log or a logger's prefix is read without its wrapper), reads it with
that format's reader, and puts messages on the queue of `Watch`, each ``(index, payload, live)``:

- `Detected`: the format, the file read, and the first lines (for the message of a log with no
  step in it);
- a list of items (`StepRecord`, `Restart`, ...): all that one read of the input gave (at most
  `BATCH`), handed over before the next read, which may wait; ``live`` is False for the file's
  history (what it held when it was opened);
- a `LogReadError`: the input cannot be read (one line);
- `Switched`: a folder's followed log changed to another (a richer log of the run, or a new
  run: `stabilizer.replay.sources`); a `Detected` and the new log's items follow;
- `Ended`, always last.

A text log that is a document (markdown, source code: `document_kind`) is refused as
``diagnose`` refuses it.
"""

from __future__ import annotations

import io
import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .document import STRUCTURED, document_kind, not_a_log
from .follow import FollowedFile, FollowedPipe, resolver
from .follow_store import follow_store, is_store_head
from .readers import READERS, LogReadError, Note
from .readers._lines import IDLE_CHUNK, text_lines
from .readers._source import HEAD, is_binary
from .readers._unwrap import unwrapped_followed
from .readers.reading import detect_head

__all__ = ["BATCH", "Detected", "Ended", "Put", "Switched", "feed"]

logger = logging.getLogger(__name__)

BATCH = 1000
"""Items handed over at once at most."""

_CONFIDENT = 0.4  # a sniff score that settles the format before `HEAD` bytes have come

Put = Callable[[tuple[int, Any, bool]], None]
"""Puts one message on the queue (waiting while it is full)."""


@dataclass(frozen=True)
class Detected:
    """The format of an input, its first lines, the file read (``"-"`` for a pipe), and the
    list its reader leaves its notes in."""

    format: str
    head: list[str]
    file: str = ""
    notes: list[Note] = field(default_factory=list)


@dataclass(frozen=True)
class Switched:
    """A folder's followed log is now ``file``: a new run's, or a richer one of the same run."""

    file: str
    new_run: bool


@dataclass(frozen=True)
class Ended:
    """An input ended."""


@dataclass(frozen=True)
class _Input:
    """One input, as `feed` got it."""

    index: int
    path: str
    format: str
    notes: list[Note]


def feed(
    index: int,
    path: str,
    format: str,
    put: Put,
    *,
    stop: threading.Event,
    tell: Callable[[str], None],
    poll: float,
) -> None:
    """Read input ``index`` (``path``) until it ends or ``stop`` is set (see the module doc).

    Args:
        index: The input's position, sent with each message.
        path: A file, a run directory, or ``-``.
        format: A reader name, or ``"auto"``.
        put: Puts a message on the queue.
        stop: Set to end the input.
        tell: Gets one line on what happens to the input (it appeared, rotated, ...).
        poll: Seconds between two looks at an input with nothing new.
    """
    try:
        if path != "-" and _store(index, path, format, put, stop, poll):
            return  # a tracker's store: asked for new rows, not read as a growing file
        source = _source(path, format, stop, tell, poll)
        try:
            while True:
                store = _read(_Input(index, path, format, []), source, put)
                if isinstance(source, FollowedFile) and not source.appeared:
                    raise LogReadError(_never(path))
                if store or not isinstance(source, FollowedFile) or source.switch is None:
                    break
                source.close()
                put((index, Switched(str(source.switch.log.path), source.switch.new_run), True))
                source = FollowedFile(path, source.resolve, stop, tell, poll, fresh=True)
        finally:
            source.close()
        if store:  # a store appeared where a log was awaited (mlflow.db made by the first run)
            _store(index, path, format, put, stop, poll)
    except LogReadError as exc:
        put((index, exc, True))
    except OSError as exc:
        put((index, LogReadError(f"{path}: cannot read ({exc.strerror or exc})"), True))
    except Exception as exc:  # never a traceback from a thread: one line, as for a reader
        logger.debug("watching %s failed", path, exc_info=True)
        put((index, LogReadError(f"{path}: cannot watch ({type(exc).__name__}: {exc})"), True))
    finally:
        put((index, Ended(), True))


def _store(
    index: int, path: str, format: str, put: Put, stop: threading.Event, poll: float
) -> bool:
    """Follow a tracker's store (`follow_store`); False when ``path`` leads to none."""
    notes: list[Note] = []

    def message(payload: Any, live: bool) -> None:
        put((index, payload, live))

    def detected(fmt: str) -> Detected:
        return Detected(fmt, [], path, notes)

    return follow_store(path, format, notes, message, detected=detected, stop=stop, poll=poll)


def _source(
    path: str, format: str, stop: threading.Event, tell: Callable[[str], None], poll: float
) -> FollowedFile | FollowedPipe:
    if path == "-":
        return FollowedPipe(sys.stdin.fileno(), stop, poll)
    source = FollowedFile(path, resolver(Path(path), format), stop, tell, poll)
    if source.waiting:  # (said after the look, so that what appears next is all new)
        there = Path(path).exists()  # a run directory without a log yet
        tell(
            f"{path}: no log in it yet; waiting for one"
            if there
            else f"{path}: not there yet; waiting for it"
        )
    return source


def _never(path: str) -> str:
    """What an input that never led to a log says at the end."""
    if Path(path).is_dir():
        return f"{path}: no log appeared in this directory while it was watched"
    return f"{path}: never appeared while it was watched"


def _read(given: _Input, source: FollowedFile | FollowedPipe, put: Put) -> bool:
    """Detect the format, read the items, hand them over in batches; True, reading nothing,
    where the file is a tracker's store (`is_store_head`)."""
    head, ended = _head(given, source)
    if given.path != "-" and is_store_head(head):
        return True
    lines = list(text_lines(io.BytesIO(head), []))
    fmt, paste = "", None
    if given.format != "auto" or head.strip() or not ended:  # (else no text came)
        fmt, paste = detect_head(head, source.path, given.format, given.notes)
    kind = document_kind(lines) if fmt and fmt not in STRUCTURED else None
    if kind is not None:  # a README or a script: whatever lines of it quote a log
        raise LogReadError(not_a_log(source.path, kind))
    file = source.file if isinstance(source, FollowedFile) else "-"
    put((given.index, Detected(fmt, lines[:20], file or "", given.notes), False))
    if not fmt:
        return False
    reader = READERS[fmt](given.notes)
    prefixed = _Prefixed(head, source)
    batch = prefixed.batch = _Batch(given.index, source, put)
    stream: Any = prefixed  # (a followed stream: its `read1` may give `IDLE_CHUNK`)
    if paste is not None:
        stream = unwrapped_followed(stream, head, paste)
    for item in reader.read(stream):
        batch.add(item)
    batch.hand_over()
    return False


def _head(given: _Input, source: FollowedFile | FollowedPipe) -> tuple[bytes, bool]:
    """The first bytes of the log, enough to tell its format (none when it is given), and
    whether the input ended before they came."""
    head = b""
    while given.format == "auto" and not _settled(head):
        more = source.read1(HEAD)
        if more is not IDLE_CHUNK and not more:
            return head, True
        head += more
    return head, False


def _settled(head: bytes) -> bool:
    """Whether the first bytes of a log tell its format: enough of them, an event file's
    header, binary data, or lines that a reader is confident of."""
    binary = any(cls.binary and cls.sniff_bytes(head) > 0.5 for cls in READERS.values())
    if len(head) >= HEAD or binary or is_binary(head):
        return bool(head)
    lines = [line for line in text_lines(io.BytesIO(head), []) if line.strip()]
    return any(cls.sniff(lines) >= _CONFIDENT for cls in READERS.values()) if lines else False


class _Batch:
    """The items read since the last read of the input: handed over together (one queue
    operation, not one per line) before the next read, which may wait."""

    def __init__(self, index: int, source: FollowedFile | FollowedPipe, put: Put) -> None:
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
