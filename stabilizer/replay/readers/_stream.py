"""`LogStream`: what `read_log` returns: the records, and what is known about the reading.

Iterating a `LogStream` iterates its records (``iter(stream)`` hands out the reader's generator
itself, so a ``for`` loop pays nothing per record); its attributes tell the format read, the
bytes read so far (for a progress bar by bytes), the segments so far, the monitor's own findings
of a ``stability.jsonl`` and the notes. The files close when the records are exhausted, on
`LogStream.close`, or when the stream is collected; standard input is never closed.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Generator, Iterator
from pathlib import Path

from stabilizer.core.records import Finding, StepRecord

from ._source import Source
from .base import BaseReader, Note, add_note
from .jsonl import JsonlReader
from .tensorboard import merge_steps

__all__ = ["LogStream"]


class LogStream(Iterator[StepRecord]):
    """The streamed records of one log (see the module docstring).

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
            self._records = self._readers[0].read(sources[0].stream, close=close)
        else:
            add_note(notes, Note("source", f"{len(sources)} event files merged by step"))
            self._records = _merged(self._readers, sources)
        # Tied to the generator, which a ``for`` loop holds once the stream itself is gone.
        self._finalizer = weakref.finalize(self._records, _close, sources)  # even if never run

    def __iter__(self) -> Iterator[StepRecord]:
        return self._records

    def __next__(self) -> StepRecord:
        return next(self._records)

    @property
    def total_bytes(self) -> int | None:
        """The size of the input in bytes (compressed, for gzip), or None for a pipe."""
        sizes = [source.size for source in self._sources]
        return None if None in sizes else sum(size or 0 for size in sizes)

    @property
    def bytes_read(self) -> int:
        """Bytes of the input read so far (compressed, for gzip); ahead of the records by a
        chunk at most, so `total_bytes` once the records are exhausted."""
        return sum(source.bytes_read for source in self._sources)

    @property
    def segment_starts(self) -> list[int]:
        """The first step of each segment read so far (`BaseReader.segment_starts`)."""
        if len(self._readers) == 1:
            return self._readers[0].segment_starts
        starts = [reader.segment_starts for reader in self._readers]
        firsts = [s[0] for s in starts if s]
        return [min(firsts), *(step for s in starts for step in s[1:])] if firsts else []

    @property
    def findings(self) -> list[Finding]:
        """The monitor's own findings in a ``stability.jsonl`` read so far; else empty."""
        return [f for r in self._readers if isinstance(r, JsonlReader) for f in r.findings]

    def close(self) -> None:
        """Stop reading and close the files (also done at the end of the records)."""
        self._records.close()
        self._finalizer()


def _merged(readers: list[BaseReader], sources: list[Source]) -> Generator[StepRecord, None, None]:
    try:
        yield from merge_steps(r.read(s.stream) for r, s in zip(readers, sources, strict=True))
    finally:
        _close(sources)


def _close(sources: list[Source]) -> None:
    for source in sources:
        source.close()
