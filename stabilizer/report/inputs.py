"""Opening a log for a diagnosis, and showing how far its reading has got.

`stabilizer.readers.read_log` returns a `LogStream`, which names the format it read (detected or
given), so a file is opened once, and standard input needs no replaying of its head here.
`progress_bar` shows the reading by bytes of the input (compressed bytes, for gzip).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, TextIO

import click

from ..readers import LogStream, Note, read_log
from ..records import StepRecord

if TYPE_CHECKING:
    from click._termui_impl import ProgressBar

__all__ = ["STDIN", "Wrap", "open_log", "progress_bar"]

STDIN = "-"
_BATCH = 4096  # records between two updates of a progress bar

Wrap = Callable[[Iterator[StepRecord]], Iterable[StepRecord]]
"""Wraps a record stream on its way to the engine (a progress bar)."""


def open_log(path: str, format: str = "auto", notes: list[Note] | None = None) -> LogStream:
    """The records of a log file, run directory or ``-`` (stdin), and the format they are in.

    Args:
        path: A file (plain or gzip), a run directory, or ``-``.
        format: A reader name, or ``"auto"`` to detect it.
        notes: Collects the reader's notes.

    Raises:
        LogReadError: The log cannot be read at all (see `read_log`).
    """
    return read_log(path, format, notes=notes)


def progress_bar(label: str, stack: contextlib.ExitStack, file: TextIO) -> Wrap:
    """A `Wrap` that shows a click progress bar on ``file``, entered into ``stack``.

    The bar counts bytes of the input when the stream tells its size (a `LogStream` of files);
    otherwise (a pipe) it counts records.
    """

    def wrap(records: Iterator[StepRecord]) -> Iterable[StepRecord]:
        if isinstance(records, LogStream) and records.total_bytes is not None:
            sized = click.progressbar(
                length=records.total_bytes, label=label, file=file, show_percent=True
            )
            return _by_bytes(records, stack.enter_context(sized))
        bar = click.progressbar(
            records, label=label, file=file, show_pos=True, update_min_steps=5000
        )
        return stack.enter_context(bar)

    return wrap


def _by_bytes(stream: LogStream, bar: ProgressBar[int]) -> Iterator[StepRecord]:
    """The records of ``stream``; every `_BATCH` of them moves ``bar`` to the bytes read."""
    shown = 0
    for count, record in enumerate(stream, 1):
        if not count % _BATCH:
            done = stream.bytes_read
            bar.update(done - shown)
            shown = done
        yield record
    bar.update(stream.bytes_read - shown)
