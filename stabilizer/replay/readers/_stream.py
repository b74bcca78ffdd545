"""`LogStream`: what `read_log` returns: the items of a log, and what is known about the reading.

Iterating a `LogStream` iterates its items, `StepRecord`s and `Restart`s (``iter(stream)`` hands
out the reader's generator itself); its attributes tell the format read, the bytes read so far
(for a progress bar by bytes), the monitor's own findings of a ``stability.jsonl`` and the notes.
The files close when the items are exhausted, on `LogStream.close`, or when the stream is
collected; standard input is never closed.
"""

from __future__ import annotations

import functools
import io
import weakref
from collections.abc import Generator, Iterator
from pathlib import Path

from stabilizer.core.records import Finding

from ._lines import text_lines
from ._source import Source
from .base import BaseReader, Item, Note, add_note
from .jsonl import JsonlReader
from .tensorboard import TensorBoardReader, merge_steps

__all__ = ["LogStream"]


class LogStream(Iterator[Item]):
    """The streamed items of one log (see the module docstring).

    Args:
        path: The path given to `read_log` (``-`` for stdin).
        format: The format the log is read as (detected or given).
        sources: The opened files: one, or the event files of a TensorBoard run.
        cls: The reader class; one reader per source.
        notes: The list the readers' notes go to.
    """

    def __init__(
        self,
        path: str | Path,
        format: str,
        sources: list[Source],
        cls: type[BaseReader],
        notes: list[Note],
    ) -> None:
        self.path, self.format, self.notes = str(path), format, notes
        self._sources = sources
        self._readers = [cls(notes) for _ in sources]
        if len(sources) == 1:
            close = functools.partial(_close, sources)
            self._items = self._readers[0].read(sources[0].stream, close=close)
        else:
            add_note(notes, Note("source", f"{len(sources)} event files merged by step"))
            self._items = _merged(self._readers, sources)
        # Tied to the generator, which a ``for`` loop holds once the stream itself is gone.
        self._finalizer = weakref.finalize(self._items, _close, sources)  # even if never run

    def __iter__(self) -> Iterator[Item]:
        return self._items

    def __next__(self) -> Item:
        return next(self._items)

    @property
    def total_bytes(self) -> int | None:
        """The size of the input in bytes (compressed, for gzip), or None for a pipe."""
        sizes = [source.size for source in self._sources]
        return None if None in sizes else sum(size or 0 for size in sizes)

    @property
    def bytes_read(self) -> int:
        """Bytes of the input read so far (compressed, for gzip); ahead of the items by a chunk
        at most, so `total_bytes` once the items are exhausted."""
        return sum(source.bytes_read for source in self._sources)

    @property
    def findings(self) -> list[Finding]:
        """The monitor's own findings in a ``stability.jsonl`` read so far; else empty."""
        return [f for r in self._readers if isinstance(r, JsonlReader) for f in r.findings]

    def head_lines(self) -> list[str]:
        """The first lines of the log (of its first 64 KiB), for a message that shows them;
        none for TensorBoard event files, which are no text."""
        if self.format == TensorBoardReader.format:
            return []
        return list(text_lines(io.BytesIO(self._sources[0].head), []))

    def close(self) -> None:
        """Stop reading and close the files (also done at the end of the items)."""
        self._items.close()
        self._finalizer()


def _merged(readers: list[BaseReader], sources: list[Source]) -> Generator[Item, None, None]:
    try:
        yield from merge_steps(r.read(s.stream) for r, s in zip(readers, sources, strict=True))
    finally:
        _close(sources)


def _close(sources: list[Source]) -> None:
    for source in sources:
        source.close()
