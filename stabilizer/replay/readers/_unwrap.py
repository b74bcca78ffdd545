"""A pasted log without its wrapper (`Paste`), streamed: what `read_log` and ``watch`` give the
readers.

The text is decoded a chunk at a time, the wrapper's one regex (`Paste.pattern`) substituted
away at every line start, and encoded again as UTF-8; a plain log never comes here.
"""

from __future__ import annotations

import codecs
import io
import re
from typing import IO

from ._lines import ANSI, CHUNK, IDLE_CHUNK, MAX_LINE, encoding_of, text_lines
from ._paste import Paste
from ._source import Source

__all__ = ["head_paste", "unwrapped", "unwrapped_followed", "unwrapped_head"]

_BREAK = re.compile(r"[\r\n]")


def unwrapped(source: Source, paste: Paste) -> Source:
    """``source`` without the wrapper: its head and its stream, as UTF-8 (whatever it was)."""
    encoding, pattern = encoding_of(source.head), paste.pattern()
    stream = io.BufferedReader(_Unwrapped(source.stream, pattern, encoding), buffer_size=CHUNK)
    head = unwrapped_head(source.head, paste)
    return Source(source.name, head, stream, source.counter, source.size)


def unwrapped_followed(stream: IO[bytes], head: bytes, paste: Paste) -> IO[bytes]:
    """A followed log (``watch``: its `read1` may give `IDLE_CHUNK`) without the wrapper, read
    with `read1`, which passes the `IDLE_CHUNK` on; ``head``: its first bytes."""
    return _Unwrapped(stream, paste.pattern(), encoding_of(head))  # type: ignore[return-value]


def unwrapped_head(head: bytes, paste: Paste) -> bytes:
    """A log's first bytes without the wrapper, as UTF-8."""
    return _Unwrapped(io.BytesIO(head), paste.pattern(), encoding_of(head)).readall()


def head_paste(head: bytes) -> Paste | None:
    """`Paste.of` the lines of a log's first bytes."""
    return Paste.of(list(text_lines(io.BytesIO(head), [])))


class _Unwrapped(io.RawIOBase):
    """The text of a binary stream with a wrapper's `pattern` taken off each line, as UTF-8.

    Decoded a chunk at a time (undecodable UTF-8 bytes pass through as they were); the unfinished
    last line waits for the next chunk, unless it grows past `MAX_LINE` (no log line: passed on
    as it is, with the rest of it). A followed stream that has nothing now (`IDLE_CHUNK`) makes
    `read1` give `IDLE_CHUNK` too.
    """

    def __init__(self, stream: IO[bytes], pattern: re.Pattern[str], encoding: str) -> None:
        self._stream, self._pattern = stream, pattern
        self._read = getattr(stream, "read1", stream.read)
        errors = "surrogateescape" if encoding.startswith("utf-8") else "replace"
        self._decoder = codecs.getincrementaldecoder(encoding)(errors)
        self._tail, self._ready, self._ended = "", memoryview(b""), False
        self._inside = False  # passing on the rest of an over-long line

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        self._fill()
        size = min(len(buffer), len(self._ready))
        buffer[:size], self._ready = self._ready[:size], self._ready[size:]
        return size

    def read1(self, size: int = -1) -> bytes:
        if not self._fill():
            return IDLE_CHUNK
        size = len(self._ready) if size < 0 else size
        data, self._ready = bytes(self._ready[:size]), self._ready[size:]
        return data

    def _fill(self) -> bool:
        """Unwrap text until some is ready or the stream ended; False: it has nothing now."""
        while not self._ready and not self._ended:
            raw = self._read(CHUNK)
            if raw is IDLE_CHUNK:
                return False
            self._ready = memoryview(self._more(raw).encode("utf-8", "surrogateescape"))
        return True

    def _more(self, raw: bytes) -> str:
        """The next piece of the text, ``raw`` read, unwrapped."""
        self._ended = not raw
        text = self._decoder.decode(raw, final=self._ended)
        done = ""
        if self._inside:  # the rest of an over-long line, up to its end, as it is
            end = _BREAK.search(text)
            cut = len(text) if end is None else end.end()
            done, text, self._inside = text[:cut], text[cut:], end is None
        text = self._tail + text
        if "\x1b" in text:  # (a colour code would hide a prefix; the readers drop them too)
            text = ANSI.sub("", text)
        cut = len(text) if self._ended else max(text.rfind("\n"), text.rfind("\r")) + 1
        if cut == 0 and len(text) > MAX_LINE:
            self._tail, self._inside = "", True
            return done + text
        self._tail = text[cut:]
        return done + self._pattern.sub("", text[:cut])

    def close(self) -> None:
        self._stream.close()
        super().close()
