"""Which reader reads a log, and the log opened as a stream of items: `read_log`.

`read_log` takes a file, a ``.gz`` file, ``-`` for stdin, or a run directory (`find_logs` picks
its log); it opens the files (`open_source`), detects the format from the first lines unless it
is given (`detect_head`, which ``watch`` calls too: the reader most confident of them, else
``generic``; a pasted log's wrapper taken off first), and returns a
`LogStream`: the reader's items, read as they are consumed, with the format, the bytes read and
the notes beside them. Opening and detection fail at once, with a `LogReadError`; reading never
fails on damage part-way (a note says where it stopped). See docs/readers.md.
"""

from __future__ import annotations

import functools
import io
import weakref
from collections.abc import Generator, Iterable, Iterator
from pathlib import Path

from ._lines import text_lines
from ._paste import Paste
from ._rundir import find_logs
from ._source import Source, is_binary, open_source
from ._unwrap import head_paste, unwrapped, unwrapped_head
from .base import BaseReader, Item, LogReadError, Note, add_note
from .csv_table import CsvTableReader
from .deepspeed import DeepSpeedReader
from .fairseq import FairseqReader
from .hf_trainer import HfTrainerReader
from .hf_trainer_state import HfTrainerStateReader
from .jsonl import JsonlReader
from .lightning_csv import LightningCsvReader
from .megatron import MegatronReader
from .tensorboard import TensorBoardReader, merge_steps
from .trackers import (
    TensorBoardCsvReader,
    WandbCsvReader,
    WandbRunReader,
    find_tracker,
    open_tracker,
)
from .universal import UniversalReader

__all__ = ["FORMAT_ALIASES", "READERS", "LogStream", "detect_format", "detect_head", "read_log"]

READERS: dict[str, type[BaseReader]] = {
    cls.format: cls
    for cls in (
        JsonlReader,
        LightningCsvReader,
        CsvTableReader,
        TensorBoardReader,
        TensorBoardCsvReader,
        WandbRunReader,
        WandbCsvReader,
        MegatronReader,
        DeepSpeedReader,
        HfTrainerReader,
        HfTrainerStateReader,
        FairseqReader,
        UniversalReader,
    )
}
"""Every reader class by format name; on equal confidence, detection prefers the earlier."""

FORMAT_ALIASES = {"nanogpt": "generic", "modded_nanogpt": "generic"}
"""Format names that are read by another reader now: the console logs of nanoGPT and
modded-nanogpt, once read by readers of their own, are read right by the generic one."""

SNIFF_LINES = 50  # meaningful lines detection looks at first
SNIFF_WIDTH = 2000  # characters of each line it looks at
_THRESHOLD = 0.1  # below this confidence a format is not detected


def detect_format(source: str | Path | Iterable[str]) -> str:
    """The format of a log file or run directory (``str`` or `Path`), or of a log's first lines.

    A text log that no dedicated reader recognises is ``generic``, read by `UniversalReader`; a
    tracker's store is its store's format (``mlflow``, ``trackio``, ``wandb_csv``).

    Raises:
        LogReadError: The path cannot be read, or holds binary data that is no event file.
    """
    if isinstance(source, (str, Path)):
        tracked = find_tracker(str(source)) if str(source) != "-" else None
        if tracked is not None:  # a tracker's store, or a run of one
            tracked[0].close()
            return tracked[0].format
        if Path(source).is_dir():
            return find_logs(Path(source), "auto", [])[0]
        opened = open_source(source)
        try:
            opened, format = _prepared(opened, "auto", [])
            return format
        finally:
            _close([opened])
    lines = [line[:SNIFF_WIDTH] for line in source]
    return _by_lines(lines[:SNIFF_LINES], lines)


def _prepared(source: Source, format: str, notes: list[Note]) -> tuple[Source, str]:
    """The format of a log (`detect_head`), and the log as its reader reads it: without the
    wrapper of a pasted log (`Paste`).

    Raises:
        LogReadError: Binary data that is no event file.
    """
    format, paste = detect_head(source.head, source.name, format, notes)
    return (source if paste is None else unwrapped(source, paste)), format


def detect_head(
    head: bytes, name: str, format: str = "auto", notes: list[Note] | None = None
) -> tuple[str, Paste | None]:
    """The format of a log from its first bytes (``format`` unless it is ``"auto"``), and the
    wrapper to take off its lines, if any: a pasted log's fences, quotes and line numbers, a
    logger's prefix (kept for a reader that finds its lines behind one: `BaseReader.prefixed`).
    The one detection of `read_log` and of ``watch`` (`stabilizer.replay.feed`).

    Args:
        head: The log's first bytes (`HEAD` of them, or all it has).
        name: The log's name, for the messages (and an event file's name).
        format: A name of `READERS`, or ``"auto"``.
        notes: Where a note says that the log is read as pasted.

    Raises:
        LogReadError: Binary data that is no event file.
    """
    for fmt, cls in READERS.items():  # event files, W&B run files: told by their bytes
        if cls.binary and (
            format == fmt or (format == "auto" and cls.sniff_bytes(head, name) > 0.5)
        ):
            return fmt, None
    if is_binary(head):
        what = "neither a text log nor an event file" if format == "auto" else f"not a {format} log"
        raise LogReadError(f"{name}: binary data, {what}")
    paste = head_paste(head)
    if paste is not None and paste.markup() != paste:
        markup = paste.markup()
        outer = _format_of(unwrapped_head(head, markup) if markup else head)
        if READERS[outer if format == "auto" else format].prefixed:
            paste = markup
    if paste is not None:
        head = unwrapped_head(head, paste)
        if paste.markup() is not None and notes is not None:
            add_note(notes, Note("source", f"read as pasted: {paste.what} taken off the lines"))
    return (_format_of(head) if format == "auto" else format), paste


def _format_of(head: bytes) -> str:
    """The format of a text log's first bytes."""
    lines = text_lines(io.BytesIO(head), [])
    meaningful = [line[:SNIFF_WIDTH] for line in lines if _meaningful(line)]
    return _by_lines(meaningful[:SNIFF_LINES], meaningful)


def _by_lines(head: list[str], more: list[str]) -> str:
    """The format that fits the first lines best, else the first 64 KiB; else ``generic``,
    which reads any console log (one it cannot read fails with `unreadable_message`)."""
    for lines in (head, more):
        scores = [(cls.sniff(lines), -rank, fmt) for rank, (fmt, cls) in enumerate(READERS.items())]
        best, _, fmt = max(scores)
        if best >= _THRESHOLD:
            return fmt
    return UniversalReader.format


def _meaningful(line: str) -> bool:
    """Not empty, not a progress-bar redraw."""
    text = line.strip()
    return bool(text) and not ("%|" in text and ("it/s]" in text or "s/it]" in text))


def read_log(
    path: str | Path, format: str = "auto", *, notes: list[Note] | None = None
) -> LogStream:
    """The items of a log, streamed (see the module docstring), as a `LogStream`.

    Opening and detection happen at once (errors raise here); reading happens as the items are
    consumed, and the files are closed when the stream is exhausted, closed or discarded. The
    stream tells the format read (``.format``), the bytes read so far (``.bytes_read`` of
    ``.total_bytes``), the monitor's findings in a ``stability.jsonl`` (``.findings``) and the
    notes (``.notes``).

    Args:
        path: A log file, a ``.gz`` file, ``-`` for stdin, or a run directory.
        format: A name of `READERS`, or ``"auto"`` to detect it.
        notes: A list that collects the `Note`s of the reading (quirks, damage).

    Raises:
        LogReadError: The path is missing or unreadable, empty, binary garbage, of an unknown
            format, or a directory with nothing readable.
    """
    format = FORMAT_ALIASES.get(format, format)
    if format != "auto" and format not in READERS:
        raise LogReadError(f"`format` must be auto or one of {', '.join(READERS)}, got {format!r}")
    notes = [] if notes is None else notes
    tracked = open_tracker(str(path), format, notes) if str(path) != "-" else None
    if tracked is not None:  # a run of a tracker's store (MLflow, trackio, a W&B export)
        return LogStream.of_items(path, *tracked, notes)
    files: list[str | Path] = [path]
    if str(path) != "-" and Path(path).is_dir():
        format, found = find_logs(Path(path), format, notes)
        files = list(found)
    sources = _open_all(files, notes)
    try:
        sources[0], format = _prepared(sources[0], format, notes)
    except LogReadError:
        _close(sources)
        raise
    return LogStream(path, format, sources, READERS[format], notes)


def _open_all(files: list[str | Path], notes: list[Note]) -> list[Source]:
    """Open every file; of several (event files of a run), empty ones are skipped."""
    sources: list[Source] = []
    try:
        for file in files:
            if len(files) > 1 and Path(file).stat().st_size == 0:
                add_note(notes, Note("source", f"{file}: empty event file skipped"))
                continue
            sources.append(open_source(file, notes))
    except LogReadError:
        _close(sources)
        raise
    except OSError as exc:
        _close(sources)
        raise LogReadError(f"{exc.filename}: cannot read ({exc.strerror})") from None
    if not sources:
        raise LogReadError(f"{files[0]}: empty file")
    return sources


def _close(sources: list[Source]) -> None:
    for source in sources:
        source.close()


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
        for reader, source in zip(self._readers, sources, strict=True):
            reader.name = source.name
        if len(sources) == 1:
            close = functools.partial(_close, sources)
            self._items = self._readers[0].read(sources[0].stream, close=close)
        else:
            add_note(notes, Note("source", f"{len(sources)} event files merged by step"))
            self._items = _merged(self._readers, sources)
        # Tied to the generator, which a ``for`` loop holds once the stream itself is gone.
        self._finalizer = weakref.finalize(self._items, _close, sources)  # even if never run

    @classmethod
    def of_items(
        cls, path: str | Path, format: str, items: Generator[Item, None, None], notes: list[Note]
    ) -> LogStream:
        """The stream of items that no file reader makes (a run of a tracker's store): no
        files, ``items`` closes what it holds when it is closed."""
        stream = cls.__new__(cls)
        stream.path, stream.format, stream.notes = str(path), format, notes
        stream._sources, stream._readers, stream._items = [], [], items
        stream._finalizer = weakref.finalize(items, _close, [])
        return stream

    def __iter__(self) -> Iterator[Item]:
        return self._items

    def __next__(self) -> Item:
        return next(self._items)

    @property
    def total_bytes(self) -> int | None:
        """The size of the input in bytes (compressed, for gzip), or None for a pipe."""
        sizes = [source.size for source in self._sources]
        return None if None in sizes or not sizes else sum(size or 0 for size in sizes)

    @property
    def bytes_read(self) -> int:
        """Bytes of the input read so far (compressed, for gzip); ahead of the items by a chunk
        at most, so `total_bytes` once the items are exhausted."""
        return sum(source.bytes_read for source in self._sources)

    def head_lines(self) -> list[str]:
        """The first lines of the log (of its first 64 KiB), for a message that shows them;
        none for a binary format (event files, W&B run files), which is no text."""
        if not self._sources or READERS[self.format].binary:
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
