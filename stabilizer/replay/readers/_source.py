"""Opening logs: files, ``-`` for stdin, gzip, and run directories; binary or text.

Every failure to open becomes a `LogReadError` with a one-line message. The first `HEAD` bytes
are read for detection and then served again, so stdin and gzip streams need no seeking.
"""

from __future__ import annotations

import gzip
import io
import os
import stat
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from .base import LogReadError, Note

__all__ = ["HEAD", "KINDS", "Source", "find_logs", "is_binary", "open_source"]

HEAD = 1 << 16  # bytes read for detection

KINDS = (  # what a directory may hold, most complete first: (format, file name pattern)
    ("jsonl", "stability.jsonl"),
    ("tensorboard", "events.out.tfevents.*"),
    ("lightning_csv", "metrics.csv"),
    ("hf_trainer_state", "trainer_state.json"),
)


@dataclass
class Source:
    """An opened log: a display name, its first bytes, and a binary stream from the start.

    ``counter`` tells how many bytes of the file (compressed ones, for gzip) have been read;
    ``size`` is the file's size when it is a regular file (else None: a pipe, a terminal).
    """

    name: str
    head: bytes
    stream: IO[bytes]
    counter: _Replay | None = None
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


class _Replay(io.RawIOBase):
    """``head`` again, then the rest of ``stream``; closes ``stream`` only if it ``owns`` it.

    ``position`` counts the bytes taken from ``stream``, ``head`` (read from it before) included.
    """

    def __init__(self, head: bytes, stream: IO[bytes], owns: bool = True) -> None:
        self._head, self._stream, self._owns = memoryview(head), stream, owns
        self._read = getattr(stream, "read1", stream.read)  # a pipe: what is there, no waiting
        self.position = len(head)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        if self._head:
            size = min(len(buffer), len(self._head))
            buffer[:size], self._head = self._head[:size], self._head[size:]
            return size
        data = self._read(len(buffer))
        size = len(data)
        buffer[:size] = data
        self.position += size
        return size

    def close(self) -> None:
        if self._owns and not self.closed:
            self._stream.close()
        super().close()


def open_source(path: str | Path) -> Source:
    """Open a file (gzip is recognised by its magic bytes) or ``-`` (stdin, never closed).

    Raises:
        LogReadError: The path is missing, unreadable, a corrupt gzip, or empty.
    """
    name = str(path)
    try:
        raw: IO[bytes] = sys.stdin.buffer if name == "-" else open(path, "rb")  # noqa: SIM115
    except FileNotFoundError:
        raise LogReadError(f"{name}: no such file or directory") from None
    except PermissionError:
        raise LogReadError(f"{name}: permission denied") from None
    except OSError as exc:
        raise LogReadError(f"{name}: cannot open ({exc.strerror or exc})") from None
    owns = name != "-"
    try:
        head = raw.read(HEAD)
        counter = _Replay(head, raw, owns)
        stream: IO[bytes] = io.BufferedReader(counter, buffer_size=_BUFFER)
        if head.startswith(b"\x1f\x8b"):
            unpacked: IO[bytes] = gzip.GzipFile(fileobj=stream, mode="rb")  # type: ignore[assignment]
            head = unpacked.read(HEAD)
            stream = _buffered(head, unpacked)
    except (OSError, EOFError, zlib.error) as exc:
        _drop(raw, owns)
        raise LogReadError(f"{name}: cannot read ({exc})") from None
    if not head:
        _drop(raw, owns)
        raise LogReadError(f"{name}: empty file")
    return Source(name, head, stream, counter, _size(raw))


_BUFFER = 1 << 16


def _buffered(head: bytes, stream: IO[bytes]) -> IO[bytes]:
    return io.BufferedReader(_Replay(head, stream), buffer_size=_BUFFER)


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
    """Whether ``head`` looks like binary data rather than text (UTF-8 or UTF-16)."""
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        return False
    if b"\x00" in head:
        return True
    text = head.decode("utf-8", "replace")
    odd = sum(1 for c in text if c == "\ufffd" or (c < " " and c not in "\t\n\r\x1b\x08\x0c"))
    return odd > max(8, len(text) // 20)


def find_logs(directory: Path, format: str, notes: list[Note]) -> tuple[str, list[Path]]:
    """The format and files of the log in a run directory (the newest run when there are several).

    Raises:
        LogReadError: Nothing readable in ``directory``.
    """
    kinds = [kind for kind in KINDS if format in ("auto", kind[0])]
    if not kinds:
        valid = ", ".join(kind for kind, _ in KINDS)
        raise LogReadError(f"{directory}: a directory reads as {valid}, not {format}: pass a file")
    for kind, pattern in kinds:
        found = sorted(p for p in _walk(directory, pattern) if p.is_file())
        if not found:
            continue
        runs = sorted({p.parent for p in found}, key=_mtime)
        if len(runs) > 1:
            why = f"{len(runs)} runs in {directory}: reading the newest, {runs[-1]}"
            notes.append(Note("source", why))
        files = [p for p in found if p.parent == runs[-1]]
        notes.append(Note("source", f"reading {kind}: {', '.join(p.name for p in files)}"))
        return kind, files
    looked = ", ".join(pattern for _, pattern in kinds)
    raise LogReadError(f"{directory}: nothing readable in this directory (looked for {looked})")


def _walk(directory: Path, pattern: str, depth: int = 4) -> list[Path]:
    """Files matching ``pattern`` up to ``depth`` levels down, hidden directories skipped."""
    found = list(directory.glob(pattern))
    if depth > 0:
        for child in sorted(directory.iterdir()) if os.access(directory, os.R_OK) else []:
            if child.is_dir() and not child.name.startswith("."):
                found += _walk(child, pattern, depth - 1)
    return found


def _mtime(directory: Path) -> tuple[float, str]:
    times = [p.stat().st_mtime for p in directory.iterdir() if p.is_file()]
    return (max(times, default=0.0), str(directory))
