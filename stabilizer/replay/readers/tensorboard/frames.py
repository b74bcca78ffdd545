"""TFRecord framing (TensorBoard event files), read in chunks with bounded memory.

A record is ``uint64 length | uint32 masked crc32c(length) | data | uint32 masked crc32c(data)``,
little-endian. The length CRC is checked on every record (cheaply: a checked 12-byte header is
remembered, and lengths repeat). The data CRC is checked only when asked (``verify=True``): CRC-32C
in pure Python costs ~0.3 µs a byte, ten times the cost of everything else, and a damaged payload
shows anyway as a protobuf that does not parse. Reading stops at the first truncated or corrupt
record, with a note; everything before it is kept.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import IO

from .._lines import IDLE_CHUNK
from ..base import Note, add_note

__all__ = ["MAX_RECORD", "frames", "header_ok", "masked_crc32c"]

MAX_RECORD = 1 << 28  # bytes; a longer length field is taken for corruption
_CHUNK = 1 << 22


def _table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _table()


def masked_crc32c(data: bytes) -> int:
    """The masked CRC-32C (Castagnoli) that TFRecord stores."""
    crc, table = 0xFFFFFFFF, _TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def header_ok(head: bytes) -> bool:
    """Whether ``head`` starts with a TFRecord header whose length CRC checks out."""
    return len(head) >= 12 and masked_crc32c(head[:8]) == struct.unpack_from("<I", head, 8)[0]


def frames(stream: IO[bytes], notes: list[Note], verify: bool = False) -> Iterator[list[bytes]]:
    """The data of the records of ``stream``, a list per chunk read; damage ends it with a note.

    Args:
        stream: A binary stream at the start of an event file.
        notes: Where damage is reported.
        verify: Also check each record's data CRC (slow).
    """
    buf, base, need = b"", 0, 12  # base: file offset of buf[0]; need: bytes for the next step
    checked: set[bytes] = set()
    # One read of the file at a time: a read that fails part-way keeps what came before it.
    read = getattr(stream, "read1", stream.read)
    while True:
        more = read(max(_CHUNK, need - len(buf)))
        if more is IDLE_CHUNK:  # a followed file waits: an empty batch tells the reader
            yield []
            continue
        if not more:
            if buf:
                _stop(notes, "truncated record", base)
            return
        buf += more
        batch, off, need = _split(buf, checked, verify)
        if need < 0:  # corrupt
            yield batch
            _stop(notes, _CORRUPT[need], base + off)
            return
        buf, base = buf[off:], base + off
        if batch:  # (an empty batch means `IDLE_CHUNK`)
            yield batch


_CORRUPT = {-1: "corrupt record header", -2: "implausible record length", -3: "corrupt record data"}


def _split(buf: bytes, checked: set[bytes], verify: bool) -> tuple[list[bytes], int, int]:
    """``(records, offset after them, bytes needed for the next)``; need < 0 means corrupt."""
    unpack, off, size = struct.unpack_from, 0, len(buf)
    batch: list[bytes] = []
    while off + 12 <= size:
        head = buf[off : off + 12]
        if head not in checked:
            if not header_ok(head):
                return batch, off, -1
            if len(checked) > 4096:
                checked.clear()
            checked.add(head)
        end = off + 16 + unpack("<Q", head)[0]
        if end - off > MAX_RECORD:
            return batch, off, -2
        if end > size:
            return batch, off, end - off
        data = buf[off + 12 : end - 4]
        if verify and masked_crc32c(data) != unpack("<I", buf, end - 4)[0]:
            return batch, off, -3
        batch.append(data)
        off = end
    return batch, off, 12


def _stop(notes: list[Note], what: str, offset: int) -> None:
    message = f"{what} at byte {offset}: read the event file up to there"
    add_note(notes, Note("truncated", message))
