"""Showing how far the reading of a log has got.

`progress_bar` shows the reading by bytes of the input (compressed bytes, for gzip).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, TextIO

import click

from stabilizer.replay.readers import Item, LogStream

if TYPE_CHECKING:
    from click._termui_impl import ProgressBar

__all__ = ["STDIN", "Wrap", "progress_bar"]

STDIN = "-"
_BATCH = 4096  # records between two updates of a progress bar

Wrap = Callable[[Iterator[Item]], Iterable[Item]]
"""Wraps a stream of records (and restarts) on its way to the engine (a progress bar)."""


def progress_bar(label: str, stack: contextlib.ExitStack, file: TextIO) -> Wrap:
    """A `Wrap` that shows a click progress bar on ``file``, entered into ``stack``.

    The bar counts bytes of the input when the stream tells its size (a `LogStream` of files);
    otherwise (a pipe) it counts records.
    """

    def wrap(records: Iterator[Item]) -> Iterable[Item]:
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


def _by_bytes(stream: LogStream, bar: ProgressBar[int]) -> Iterator[Item]:
    """The items of ``stream``; every `_BATCH` of them moves ``bar`` to the bytes read."""
    shown = 0
    for count, record in enumerate(stream, 1):
        if not count % _BATCH:
            done = stream.bytes_read
            bar.update(done - shown)
            shown = done
        yield record
    bar.update(stream.bytes_read - shown)
