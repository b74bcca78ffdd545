"""Opening logs: files, named pipes, ``-`` for stdin, gzip; binary or text.

Every failure to open becomes a `LogReadError` with a one-line message. The first `HEAD` bytes
are read for detection and then served again, so stdin and gzip streams need no seeking.
"""

from __future__ import annotations

import gzip
import io
import os
import select
import stat
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from .base import LogReadError, Note, add_note

__all__ = ["HEAD", "PIPE_WAIT", "Source", "is_binary", "open_source"]

HEAD = 1 << 16  # bytes read for detection
PIPE_WAIT = 10.0  # seconds a named pipe may keep its first bytes waiting before it is refused


@dataclass
class Source:
    """An opened log: a display name, its first bytes, and a binary stream from the start.

    ``counter`` tells how many bytes of the file (compressed ones, for gzip) have been read;
    ``size`` is the file's size when it is a regular file (else None: a pipe, a terminal).
    """

    name: str
    head: bytes
    stream: IO[bytes]
    counter: _HeadAgain | None = None
    size: int | None = None

    @property
    def bytes_read(self) -> int:
        """Bytes read off the file so far (the readers read ahead by up to a chunk)."""
        return 0 if self.counter is None else self.counter.position

    def close(self) -> None:
        """Close the stream and the file under it (gzip leaves it open); stdin stays open."""
        self.stream.close()
        if self.counter is not None:
            self.counter.close()


class _HeadAgain(io.RawIOBase):
    """``head`` again, then the rest of ``stream``; closes ``stream`` only if it ``owns`` it.

    ``position`` counts the bytes taken from ``stream``, ``head`` (read from it before) included.
    A read that fails (an I/O error, damaged gzip data) ends the stream there, with a note in
    ``notes``: the readers read a chunk ahead, so an error raised to them would cost the chunk
    before it.
    """

    def __init__(
        self,
        head: bytes,
        stream: IO[bytes] | io.RawIOBase,
        owns: bool = True,
        notes: list[Note] | None = None,
    ) -> None:
        self._head, self._stream, self._owns = memoryview(head), stream, owns
        self._read = getattr(stream, "read1", stream.read)  # a pipe: what is there, no waiting
        self._notes = [] if notes is None else notes
        self._stopped = False
        self.position = len(head)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        if self._head:
            size = min(len(buffer), len(self._head))
            buffer[:size], self._head = self._head[:size], self._head[size:]
            return size
        if self._stopped:
            return 0
        try:
            data = self._read(len(buffer))
        except (OSError, EOFError, zlib.error) as exc:
            self._stopped = True
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            message = f"{why} after {self.position} bytes: read up to there"
            add_note(self._notes, Note("truncated", message))
            return 0
        size = len(data)
        buffer[:size] = data
        self.position += size
        return size

    def close(self) -> None:
        if self._owns and not self.closed:
            self._stream.close()
        super().close()


def open_source(path: str | Path, notes: list[Note] | None = None) -> Source:
    """Open a file (gzip is recognised by its magic bytes), a pipe, or ``-`` (stdin, never closed).

    A file that fails part-way (an I/O error; gzip data cut short or with a bad CRC) reads up to
    the failure, which ends it with a ``truncated`` note in ``notes``.

    Raises:
        LogReadError: The path is missing, unreadable, not a regular file or a pipe, a pipe
            with no writer, a corrupt gzip from its first bytes, or empty.
    """
    name = str(path)
    raw = sys.stdin.buffer if name == "-" else _open_file(name)
    owns = name != "-"
    try:
        head = raw.read(HEAD)
        counter = _HeadAgain(head, raw, owns, notes)
        stream: IO[bytes] = io.BufferedReader(counter, buffer_size=_BUFFER)
        if head.startswith(b"\x1f\x8b"):
            head, stream = _gunzip(stream, notes)
    except (OSError, EOFError, zlib.error) as exc:
        _drop(raw, owns)
        raise LogReadError(f"{_shown(name)}: cannot read ({exc})") from None
    if not head:
        _drop(raw, owns)
        empty = "empty (nothing was written to it)" if name == "-" else "empty file"
        raise LogReadError(f"{_shown(name)}: {empty}")
    return Source(name, head, stream, counter, _size(raw))


def _shown(name: str) -> str:
    """A path as messages name it: ``-`` is standard input."""
    return "standard input" if name == "-" else name


def _open_file(name: str) -> IO[bytes]:
    """A regular file or a pipe that has data (waiting up to `PIPE_WAIT`); nothing else."""
    try:  # non-blocking: opening a FIFO with no writer would otherwise wait forever
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        raise LogReadError(f"{name}: no such file or directory") from None
    except PermissionError:
        raise LogReadError(f"{name}: permission denied") from None
    except OSError as exc:
        raise LogReadError(f"{name}: cannot open ({exc.strerror or exc})") from None
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "a device or a socket"
        raise LogReadError(f"{name}: {kind}, not a log file")
    if stat.S_ISFIFO(mode):
        if not select.select([fd], [], [], PIPE_WAIT)[0]:
            os.close(fd)
            raise LogReadError(f"{name}: a pipe that nothing was written to in {PIPE_WAIT:g} s")
        os.set_blocking(fd, True)  # a writer is there: from now on, wait for it as stdin does
    return os.fdopen(fd, "rb")


def _gunzip(stream: IO[bytes], notes: list[Note] | None) -> tuple[bytes, IO[bytes]]:
    """The first `HEAD` unpacked bytes and a stream of all of them, from their start.

    Read a piece at a time, so that damage within the first `HEAD` bytes keeps what came before
    it: the stream then ends there, with a note.
    """
    unpacked = gzip.GzipFile(fileobj=stream, mode="rb")
    pieces: list[bytes] = []
    size, damage = 0, None
    try:
        while size < HEAD and (piece := unpacked.read1(HEAD - size)):
            pieces.append(piece)
            size += len(piece)
    except (OSError, EOFError, zlib.error) as exc:
        if not pieces:
            raise
        damage = exc
    head = b"".join(pieces)
    if damage is not None and b"\n" in head:  # the line the damage cut is no record
        head = head[: head.rindex(b"\n") + 1]
    replay = _HeadAgain(head, _Gunzipped(unpacked, damage), notes=notes)
    return head, io.BufferedReader(replay, buffer_size=_BUFFER)


class _Gunzipped(io.RawIOBase):
    """The rest of an unpacking gzip stream; damage raises an `OSError` that names it.

    A piece's last line is held back until the next piece ends it: damage cuts a line anywhere
    (``loss 3.`` of ``loss 3.4073``), and a cut line must not be read as a record.

    Args:
        unpacked: The gzip stream.
        damage: The error that has already stopped the unpacking, if any.
    """

    def __init__(self, unpacked: gzip.GzipFile, damage: BaseException | None = None) -> None:
        self._unpacked, self._damage = unpacked, damage
        self._ready, self._held, self._ended = memoryview(b""), b"", False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        while not self._ready and not self._ended:
            if self._damage is not None:  # what is held back is the line the damage cut
                raise OSError(f"damaged gzip data ({self._damage})")
            self._unpack(len(buffer))
        size = min(len(buffer), len(self._ready))
        buffer[:size], self._ready = self._ready[:size], self._ready[size:]
        return size

    def _unpack(self, size: int) -> None:
        try:
            data = self._held + self._unpacked.read1(size)
        except (OSError, EOFError, zlib.error) as exc:
            self._damage = exc
            return
        self._ended = len(data) == len(self._held)  # the end: the last line is whole
        cut = len(data) if self._ended else data.rfind(b"\n") + 1
        if cut == 0 and len(data) >= _BUFFER:  # no line at all (binary data): hold nothing
            cut = len(data)
        self._ready, self._held = memoryview(data)[:cut], data[cut:]

    def close(self) -> None:
        self._unpacked.close()
        super().close()


_BUFFER = 1 << 16


def _drop(raw: IO[bytes], owns: bool) -> None:
    if owns:
        raw.close()


def _size(raw: IO[bytes]) -> int | None:
    """The size of a regular file (stdin redirected from one included), else None."""
    try:
        info = os.fstat(raw.fileno())
    except (OSError, ValueError, AttributeError):  # io.BytesIO and friends: no descriptor
        return None
    return info.st_size if stat.S_ISREG(info.st_mode) else None


def is_binary(head: bytes) -> bool:
    """Whether ``head`` looks like binary data rather than text (UTF-8 or UTF-16).

    Control characters and undecodable bytes count against it, NULs do not: a log that a crash
    left with blocks of NULs in it (pages the file system had not written yet) is still a log.
    """
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        return False
    text = head.replace(b"\x00", b"").decode("utf-8", "replace")
    odd = sum(1 for c in text if c == "\ufffd" or (c < " " and c not in "\t\n\r\x1b\x08\x0c"))
    return odd > max(8, len(text) // 20)
