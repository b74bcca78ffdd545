"""One ``stabilizer diagnose`` run, minus the terminal: inputs in, outcomes and output files out.

The command line (`stabilizer.cli`) prints; this module decides. A directory of several runs is
several inputs (`expand_runs`). Each input gets its own diagnosis, its own TensorBoard run and
its own plot. Every output path is checked before the
first input is read (`plan_outputs`); outputs never replace or add to what is there unless
``force`` (see `stabilizer.report.files`). An input that cannot be read, or whose outputs cannot
be written, becomes a `Failure` with a one-line message that says which, never a traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from stabilizer.replay.diagnose import Diagnosis, Failure, diagnose
from stabilizer.replay.readers import LogReadError, find_runs
from stabilizer.replay.readers.trackers import store_addresses

from .files import OutputError, check_file, check_run_dir
from .inputs import Wrap, progress_bar

__all__ = [
    "OutputError",
    "Outputs",
    "diagnose_input",
    "expand_runs",
    "plan_outputs",
    "plot_path",
    "progress_bar",
    "run_dir",
    "warnings_as_lines",
]


def expand_runs(paths: Sequence[str], format: str = "auto") -> list[str]:
    """Each input, a directory of several runs (``runs/``, a Lightning ``lightning_logs/``) or a
    tracker's store of several (``mlflow.db``, ``mlruns/``) as each of its runs, in order, so
    that every run is diagnosed, not only the newest."""
    expanded: list[str] = []
    for path in paths:
        runs: list[str | Path] = [*store_addresses(path, format)] if path != "-" else []
        if not runs and path != "-" and _is_dir(path):
            runs = [*find_runs(Path(path), format)]
        expanded += [str(run) for run in runs] if len(runs) > 1 else [path]
    return expanded


def _is_dir(path: str) -> bool:
    try:
        return Path(path).is_dir()
    except OSError:
        return False


@dataclass(frozen=True)
class Outputs:
    """Where the outputs of one input go (None: not asked for).

    Args:
        plot: The PNG file.
        tensorboard: The TensorBoard run directory.
        force: Replace an existing plot; write into a non-empty run directory, replacing an
            earlier replay there.
    """

    plot: Path | None = None
    tensorboard: Path | None = None
    force: bool = False


def plot_path(base: Path | None, index: int, count: int) -> Path | None:
    """The plot of input ``index`` of ``count``: ``base`` for one, ``FILE-2.png`` for the 2nd."""
    if base is None or count == 1:
        return base
    return base.with_name(f"{base.stem}-{index}{base.suffix}")


def run_dir(base: Path | None, index: int, count: int, path: str) -> Path | None:
    """The TensorBoard run of input ``index`` of ``count``: ``base``, or ``base/2-<name>``."""
    if base is None or count == 1:
        return base
    name = Path(path).name.removesuffix(".gz") if path != "-" else "stdin"
    return base / f"{index}-{name or 'log'}"


def plan_outputs(
    paths: Sequence[str], plot: Path | None, tb_dir: Path | None, force: bool
) -> list[Outputs]:
    """The outputs of each input, every one checked before anything is read.

    Raises:
        OutputError: An output is missing its folder or matplotlib, would replace or add to
            something (without ``force``), is a symbolic link directory, or is an input.
    """
    if plot is not None:
        from .plot import PlotUnavailable, require_matplotlib

        try:
            require_matplotlib()
        except PlotUnavailable as exc:
            raise OutputError(str(exc)) from None
    if tb_dir is not None:
        check_run_dir(tb_dir, "--tensorboard", force)
        try:
            tb_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            why = exc.strerror or exc
            raise OutputError(
                f"{tb_dir}: cannot create the TensorBoard directory ({why})"
            ) from None
    plans = []
    for index, path in enumerate(paths, 1):
        outputs = Outputs(
            plot_path(plot, index, len(paths)), run_dir(tb_dir, index, len(paths), path), force
        )
        if outputs.plot is not None:
            check_file(outputs.plot, "--plot", force)
            if any(_same(outputs.plot, Path(name)) for name in paths):
                raise OutputError(f"{outputs.plot}: is one of the inputs; --plot needs another")
        if outputs.tensorboard is not None and outputs.tensorboard != tb_dir:
            check_run_dir(outputs.tensorboard, "--tensorboard", force)
        plans.append(outputs)
    return plans


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # either is missing (or ``-``)
        return False


def diagnose_input(
    path: str, format: str, outputs: Outputs = Outputs(), wrap: Wrap | None = None
) -> tuple[Diagnosis | Failure, list[str]]:
    """Diagnose one input; write its TensorBoard run and its plot when asked.

    Returns:
        The diagnosis (or the failure) and one line per output written or note on it.
    """
    messages: list[str] = []
    try:
        diagnosis = _diagnose(path, format, outputs, wrap, messages)
        if outputs.plot is not None:
            messages += _plot(diagnosis, path, outputs.plot, outputs.force)
    except (LogReadError, OutputError) as exc:
        return Failure(path, str(exc)), messages
    except OSError as exc:  # the outputs raise OutputError: this one came from the reading
        return Failure(
            path, f"{exc.filename or path}: cannot read ({exc.strerror or exc})"
        ), messages
    return diagnosis, messages


def _diagnose(
    path: str, format: str, outputs: Outputs, wrap: Wrap | None, messages: list[str]
) -> Diagnosis:
    run = outputs.tensorboard
    if run is None:
        return diagnose(path, format, wrap=wrap)
    from .tensorboard_export import TensorBoardExport

    with TensorBoardExport(run, replace=outputs.force) as export:
        diagnosis = diagnose(path, format, sinks=[export], wrap=wrap)
        notes = export.finish(diagnosis)
    messages.append(f"TensorBoard run of {path}: {run}")  # (the command: `stabilizer.cli`)
    messages += notes
    return diagnosis


def _plot(diagnosis: Diagnosis, path: str, picture: Path, force: bool) -> list[str]:
    from .plot import plot_diagnosis

    try:
        notes = plot_diagnosis(diagnosis, picture, force)
    except FileExistsError:
        raise OutputError(f"{picture}: appeared meanwhile; pass --force to replace it") from None
    except OSError as exc:
        raise OutputError(f"{picture}: cannot write ({exc.strerror or exc})") from None
    return [f"plot of {path}: {picture}", *notes]


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
