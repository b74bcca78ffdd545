"""Showing how far the reading of a log has got.

`progress_bar` shows the reading on a click progress bar, by bytes of the input (compressed
bytes, for gzip) or, for a pipe, by records; as tqdm's ``delay`` does, only once the reading has
lasted `PROGRESS_DELAY` seconds: a log read in a blink shows nothing, a long one (a million
lines: seconds) is never silent.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, TextIO

import click

from stabilizer.replay.readers import Item, LogStream

if TYPE_CHECKING:
    from click._termui_impl import ProgressBar

__all__ = ["PROGRESS_DELAY", "STDIN", "Wrap", "progress_bar"]

STDIN = "-"
PROGRESS_DELAY = 1.0
"""Seconds of reading before the bar shows (pip's and tqdm's habit: no bar for a quick read)."""
_BATCH = 4096  # records between two looks at the clock and the bar
_clock = time.monotonic  # (a test reads a long log in a blink by moving it on)

Wrap = Callable[[Iterator[Item]], Iterable[Item]]
"""Wraps a stream of records (and restarts) on its way to the engine (a progress bar)."""


def progress_bar(
    label: str, stack: contextlib.ExitStack, file: TextIO, delay: float | None = None
) -> Wrap:
    """A `Wrap` that shows a click progress bar on ``file`` (entered into ``stack``) once the
    reading has lasted ``delay`` seconds (`PROGRESS_DELAY` when None).

    The bar counts bytes of the input when the stream tells its size (a `LogStream` of files);
    otherwise (a pipe) it counts records.
    """
    wait = PROGRESS_DELAY if delay is None else delay

    def wrap(records: Iterator[Item]) -> Iterable[Item]:
        def open_bar() -> ProgressBar[int]:
            total = records.total_bytes if isinstance(records, LogStream) else None
            if total is not None:
                bar = click.progressbar(length=total, label=label, file=file, show_percent=True)
            else:  # (no length: the position, in records)
                bar = click.progressbar(iter(()), label=label, file=file, show_pos=True)
            return stack.enter_context(bar)

        return _shown(records, open_bar, _clock() + wait)

    return wrap


def _shown(
    records: Iterator[Item], open_bar: Callable[[], ProgressBar[int]], due: float
) -> Iterator[Item]:
    """The items of ``records``; at the first and every `_BATCH` of them, the bar (opened once
    ``due`` has come) moves to the bytes read, or the records read for a stream of unknown
    size."""
    sized = isinstance(records, LogStream) and records.total_bytes is not None
    bar: ProgressBar[int] | None = None
    shown = count = 0
    for count, record in enumerate(records, 1):
        if count == 1 or not count % _BATCH:
            if bar is None and _clock() >= due:
                bar = open_bar()
            if bar is not None:
                done = records.bytes_read if sized else count  # type: ignore[attr-defined]
                bar.update(done - shown)
                shown = done
        yield record
    if bar is not None:
        bar.update((records.bytes_read if sized else count) - shown)  # type: ignore[attr-defined]
