"""The framing of W&B's ``run-*.wandb`` files: a W&B header, then the LevelDB log format.

How wandb writes it (``wandb/sdk/internal/datastore.py`` before 0.18; the Go core's
``core/pkg/leveldb`` writer with ``CRCAlgoIEEE`` since): the 7-byte header `MAGIC` (``:W&B``,
0xBEE1, version 0), then 32 KiB blocks counted from the start of the file, the header included.
A block is a run of chunks, each ``uint32 crc | uint16 length | uint8 type | data``, little-endian;
the CRC is zlib's CRC-32 (IEEE, not LevelDB's masked CRC-32C) of the type byte and the data. A
record is one FULL chunk, or a FIRST, MIDDLE..., LAST run of them across blocks; a block's last
six bytes or fewer, too few for a header, are zero padding.

`records` reads them in chunks with bounded memory (a record at a time). Every CRC is checked:
a chunk whose CRC or type is wrong is skipped to the next block, where the writer started afresh
(LevelDB's own recovery), with a note; so is a block of zeros. A chunk cut short at the end of
the file is a run still writing: a followed file waits for the rest; a finished read ends there,
with a note. A W&B header where a chunk should be is a new file (a followed path that now leads
to a newer run's file): blocks count from it.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from typing import IO

from .._lines import IDLE_CHUNK
from ..base import LogReadError, Note, add_note

__all__ = ["BLOCK", "MAGIC", "records"]

MAGIC = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 1 << 15
_HEAD = 7  # a chunk's header, and the W&B header
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
_TYPE_CRC = [zlib.crc32(bytes([kind])) for kind in range(5)]  # the CRC of the type byte alone
_READ = 1 << 20


class _Chunks:
    """The state of the framing: where the next chunk starts, the record being put together."""

    def __init__(self, notes: list[Note]) -> None:
        self.notes = notes
        self.origin = 0  # file offset of the W&B header the blocks count from
        self.pos = _HEAD  # file offset of the next chunk
        self.parts: list[bytes] | None = None  # the fragments of a FIRST..LAST record
        self.recovering = False  # after damage: MIDDLE and LAST chunks are no record's

    def split(self, buf: bytes, base: int) -> tuple[list[bytes], bool]:
        """The records complete in ``buf`` (which starts at file offset ``base``), and whether
        the chunk at `pos` is cut short (more bytes are needed)."""
        found: list[bytes] = []
        while True:
            record = self._chunk(buf, base)
            if isinstance(record, bool):
                return found, record
            if record is not None:
                found.append(record)

    def _chunk(self, buf: bytes, base: int) -> bytes | bool | None:
        """Read the chunk at `pos`: the record it completes (None: none), or, where ``buf``
        ends within the chunk or just before it, whether more bytes are needed."""
        end = base + len(buf)
        left = BLOCK - (self.pos - self.origin) % BLOCK
        if left < _HEAD:  # the block's zero padding
            return self._skip(left, end)
        if self.pos + _HEAD > end:
            return self.pos < end
        at = self.pos - base
        crc, length, kind = struct.unpack_from("<IHB", buf, at)
        if crc == length == kind == 0:  # zeros: nothing was written in the rest of the block
            return self._skip(left, end)
        if not _FULL <= kind <= _LAST or _HEAD + length > left:
            self._damaged(buf, base, "a chunk of no known type or length")
            return None
        if self.pos + _HEAD + length > end:
            return True
        data = buf[at + _HEAD : at + _HEAD + length]
        if zlib.crc32(data, _TYPE_CRC[kind]) != crc:
            self._damaged(buf, base, "a chunk whose CRC does not match")
            return None
        self.pos += _HEAD + length
        return self._fragment(kind, data)

    def _skip(self, left: int, end: int) -> bool | None:
        """Past the rest of the block, once it is there (True: not yet)."""
        if self.pos + left > end:
            return True
        self.pos += left
        return None

    def _fragment(self, kind: int, data: bytes) -> bytes | None:
        """The record a chunk completes, if any."""
        if kind in (_FULL, _FIRST):
            self.recovering = False
            if kind == _FULL:
                self.parts = None
                return data
            self.parts = [data]
            return None
        if self.parts is None:  # a record's tail after damage, or after a new file began
            return None
        self.parts.append(data)
        if kind == _MIDDLE:
            return None
        record, self.parts = b"".join(self.parts), None
        return record

    def _damaged(self, buf: bytes, base: int, what: str) -> None:
        """Skip damage: to a W&B header within the block (a new file), else to the next block."""
        at = self.pos - base
        left = BLOCK - (self.pos - self.origin) % BLOCK
        header = buf.find(MAGIC, at, at + left)
        if header >= 0:
            self.origin = base + header
            self.pos = self.origin + _HEAD
            self.parts = None
            return
        if not self.recovering:
            where = f"byte {self.pos}"
            add_note(self.notes, Note("skipped", f"{what} at {where}: skipped to the next block"))
        self.recovering, self.parts = True, None
        self.pos += left


def records(stream: IO[bytes], notes: list[Note]) -> Iterator[list[bytes]]:
    """The records of a ``.wandb`` stream, a list per read; an empty list where a followed file
    waits (`IDLE_CHUNK`), so that the reader hands out what it holds.

    Raises:
        LogReadError: The stream does not start with the W&B header.
    """
    read = getattr(stream, "read1", stream.read)
    buf, base = b"", 0
    chunks = _Chunks(notes)
    short = False
    while True:
        more = read(_READ)
        if more is IDLE_CHUNK:
            yield []
            continue
        if not more:
            break
        whole = base == 0 and len(buf) < _HEAD <= len(buf) + len(more)  # the header has come
        if whole and not (buf + more).startswith(MAGIC):
            raise LogReadError("no W&B header (:W&B): not a W&B run file")
        buf += more
        if base + len(buf) < _HEAD:
            continue
        found, short = chunks.split(buf, base)
        keep = min(chunks.pos, base + len(buf)) - base
        buf, base = buf[keep:], base + keep
        if found:
            yield found
    if base + len(buf) < _HEAD and (base or buf):
        raise LogReadError("shorter than the W&B header: not a W&B run file")
    if short or chunks.parts is not None:
        message = f"the last record is cut short at byte {chunks.pos} (a run still writing)"
        add_note(notes, Note("truncated", f"{message}: read up to there"))
