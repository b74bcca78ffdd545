"""One ``stabilizer diagnose`` run, minus the terminal: inputs in, outcomes and output files out.

The command line (`stabilizer.cli`) prints; this module decides. Each input gets its own
diagnosis, its own TensorBoard run and its own plot; an input that cannot be read, or whose
outputs cannot be written, becomes a `Failure` with a one-line message and never a traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from stabilizer.replay.diagnose import Diagnosis, Failure, RecordSink, diagnose
from stabilizer.replay.readers import LogReadError

from .inputs import Wrap, progress_bar

__all__ = [
    "PROGRESS_BYTES",
    "diagnose_input",
    "needs_progress",
    "output_path",
    "prepare_outputs",
    "progress_bar",
    "warnings_as_lines",
]

PROGRESS_BYTES = 50 * 2**20
"""Files larger than this are worth a progress bar (`progress_bar`, by bytes read)."""


def needs_progress(path: str) -> bool:
    """Whether ``path`` is a file larger than `PROGRESS_BYTES`."""
    file = Path(path)
    try:
        return path != "-" and file.is_file() and file.stat().st_size > PROGRESS_BYTES
    except OSError:
        return False


def prepare_outputs(plot: Path | None, tb_dir: Path | None) -> str:
    """Check what the outputs need before a long read; the problem in one line, or ``""``."""
    if plot is not None:
        from .plot import PlotUnavailable, require_matplotlib

        try:
            require_matplotlib()
        except PlotUnavailable as exc:
            return str(exc)
        folder = plot.parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            return f"{folder}: the --plot folder does not exist or is not writable"
    if tb_dir is not None:
        try:
            tb_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"{tb_dir}: cannot create the TensorBoard directory ({exc.strerror or exc})"
    return ""


def output_path(base: Path | None, index: int, count: int, path: str) -> Path | None:
    """The plot file or TensorBoard run of input ``index`` of ``count`` (``base`` for one).

    Several inputs: ``FILE.png`` becomes ``FILE-2.png``; ``DIR`` gets ``DIR/2-<input name>``.
    """
    if base is None or count == 1:
        return base
    if base.suffix:
        return base.with_name(f"{base.stem}-{index}{base.suffix}")
    name = Path(path).name.removesuffix(".gz") if path != "-" else "stdin"
    return base / f"{index}-{name or 'log'}"


def diagnose_input(
    path: str,
    format: str,
    index: int = 1,
    count: int = 1,
    *,
    plot: Path | None = None,
    tb_dir: Path | None = None,
    wrap: Wrap | None = None,
) -> tuple[Diagnosis | Failure, list[str]]:
    """Diagnose input ``index`` of ``count``; write its TensorBoard run and plot when asked.

    Returns:
        The diagnosis (or the failure) and one line per output file written.
    """
    messages = []
    tb, picture = output_path(tb_dir, index, count, path), output_path(plot, index, count, path)
    try:
        with contextlib.ExitStack() as stack:
            sinks: list[RecordSink] = []
            if tb is not None:
                from .tensorboard_export import TensorBoardExport

                export = stack.enter_context(TensorBoardExport(tb))
                sinks.append(export)
            diagnosis = diagnose(path, format, sinks=sinks, wrap=wrap)
            if tb is not None:
                export.finish(diagnosis)
                messages.append(f"TensorBoard run of {path}: {tb} (tensorboard --logdir {tb})")
        if picture is not None:
            from .plot import plot_diagnosis

            plot_diagnosis(diagnosis, picture)
            messages.append(f"plot of {path}: {picture}")
    except LogReadError as exc:
        return Failure(path, str(exc)), messages
    except OSError as exc:
        where = exc.filename or picture or tb
        return Failure(path, f"{where}: cannot write ({exc.strerror or exc})"), messages
    return diagnosis, messages


class _OneLine(logging.Formatter):
    """``<prefix>: warning: <message>``: one line, never a traceback."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        return f"{self.prefix}: {record.levelname.lower()}: {record.getMessage()}"


@contextlib.contextmanager
def warnings_as_lines(stream: TextIO, prefix: str) -> Iterator[None]:
    """While inside, the package's warnings (a detector that raised) go to ``stream`` as lines.

    Without a handler, Python's last-resort handler would print the traceback a detector logs.
    """
    handler = logging.StreamHandler(stream)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(_OneLine(prefix))
    logger = logging.getLogger("stabilizer")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
