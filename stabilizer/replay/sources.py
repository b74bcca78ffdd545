"""Which log a watch of a folder follows: the newest run below it, and that run's richest log.

A *run* is a directory holding a log; its logs are ranked by what they tell (`RICHNESS`): the
monitor's ``stability.jsonl`` (every step, the run's facts, the root cause) over TensorBoard event
files, over Lightning's ``metrics.csv``, over a console log (``*.log``, ``*.out``). Below the
folder given, at any depth (hidden directories skipped, no symbolic link followed), the newest
run is the one whose log was written last.

`RunFinder` is that choice kept over time, so that a watch neither lets go of its run nor
flaps between two that both grow:

- at the first look: the newest run, its richest log;
- later, a richer log of the same run (the JSONL the monitor opens at fit start, a moment after
  Lightning's event file) is a *switch* of source, not a rotation;
- a log that appears in another directory is a new run (``runs/exp1/`` created after
  ``runs/exp0/``), and so is a new log as rich beside the one followed (a resumed process's
  new event file): followed from its start;
- anything else leaves the choice as it is (a log that grows elsewhere is no reason to move).

Event files that ``stabilizer diagnose --tensorboard`` wrote (a replay of another log) are no
run's log, nor is a console log in whose first 64 KiB no line reads as a training record (a
tracker's ``debug.log``, a ``pip.log``): what a person reading it would see, by the universal
reader; it is looked at again when it grows.

`newest_source` is the one function that ranks what a folder holds; another kind of store
(a tracker's run folder) joins by a row of `RICHNESS`.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from stabilizer.core.records import StepRecord

from .readers._lines import text_lines
from .readers._rundir import REPLAY_SUFFIX
from .readers._source import HEAD
from .readers.universal import UniversalReader

__all__ = ["CONSOLE", "DEPTH", "RICHNESS", "Choice", "LogFile", "RunFinder", "newest_source"]

CONSOLE = "auto"
"""The format of a console log found in a folder: detected from its first lines."""

RICHNESS: tuple[tuple[str, str], ...] = (
    ("jsonl", "stability.jsonl"),
    ("tensorboard", "events.out.tfevents.*"),
    ("lightning_csv", "metrics.csv"),
    (CONSOLE, "*.log"),
    (CONSOLE, "*.out"),
)
"""(format, file name pattern), the richest first. A ``trainer_state.json`` is no row: the HF
Trainer rewrites it whole at each checkpoint, so it cannot be followed."""

DEPTH = 16
"""Directory levels looked into below the folder given."""


@dataclass(frozen=True)
class LogFile:
    """A log found below the folder: the file, its format, its rank in `RICHNESS` (0 richest)
    and when it was last written."""

    path: Path
    format: str
    rank: int
    mtime: float

    @property
    def run(self) -> Path:
        """The run: the directory that holds the log."""
        return self.path.parent


@dataclass(frozen=True)
class Choice:
    """What a look at the folder decided: the log to follow, and whether it starts a new run
    (a log of another run appeared) rather than replacing the source of the same run."""

    log: LogFile
    new_run: bool = False


def _kind(name: str, format: str) -> tuple[str, int] | None:
    """The format and rank of a file named ``name`` (None: no log), ``format`` forced or auto."""
    if name.endswith(REPLAY_SUFFIX):
        return None
    for rank, (kind, pattern) in enumerate(RICHNESS):
        if fnmatchcase(name, pattern):
            if format not in ("auto", kind) and kind != CONSOLE:
                return None
            return (kind if format == "auto" else format), rank
    return None


def scan(folder: Path, format: str = "auto") -> list[LogFile]:
    """Every log below ``folder`` (see the module docstring), in path order."""
    found: list[LogFile] = []
    _visit(str(folder), format, DEPTH, found)
    return sorted(found, key=lambda log: str(log.path))


def _visit(directory: str, format: str, depth: int, found: list[LogFile]) -> None:
    try:
        with os.scandir(directory) as listing:
            entries = list(listing)
    except OSError:  # unreadable, or gone: nothing to find there
        return
    for entry in entries:
        try:
            if entry.is_symlink():
                continue
            if entry.is_dir():
                if depth > 0 and not entry.name.startswith("."):
                    _visit(entry.path, format, depth - 1, found)
                continue
            kind = _kind(entry.name, format)
            if kind is not None and entry.is_file():
                found.append(LogFile(Path(entry.path), *kind, entry.stat().st_mtime))
        except OSError:  # (gone between the listing and the look)
            continue


def newest_source(logs: list[LogFile]) -> LogFile | None:
    """The richest log of the newest run among ``logs`` (None: none)."""
    if not logs:
        return None
    newest = max(logs, key=lambda log: (log.mtime, str(log.path))).run
    return _richest([log for log in logs if log.run == newest])


def _richest(logs: list[LogFile]) -> LogFile:
    return min(logs, key=lambda log: (log.rank, -log.mtime, str(log.path)))


class RunFinder:
    """The log a watch of ``folder`` follows, looked for again at each `look`.

    Args:
        folder: The folder given.
        format: A reader name, or ``"auto"``.
    """

    def __init__(self, folder: Path, format: str = "auto") -> None:
        self.folder, self.format = folder, format
        self.current: LogFile | None = None
        self._known: set[Path] | None = None  # the logs of the last look (None: no look yet)
        self._console: dict[Path, tuple[float, bool]] = {}  # mtime, and whether it has records

    def look(self) -> Choice | None:
        """The log to follow now; None while there is none. A choice that is no change (the
        same file) is the current one again."""
        logs = scan(self.folder, self.format) if self.folder.is_dir() else []
        logs = [log for log in logs if log.format != CONSOLE or self._training(log)]
        known, self._known = self._known, {log.path for log in logs}
        current = self.current
        if current is None:
            chosen = newest_source(logs)
            if chosen is None:
                return None
            self.current = chosen
            return Choice(chosen, new_run=known is not None and chosen.path not in known)
        fresh = [log for log in logs if known is not None and log.path not in known]
        elsewhere = [log for log in fresh if log.run != current.run or log.rank == current.rank]
        if elsewhere:  # a new run started: its richest log
            self.current = newest_source(elsewhere)
            return Choice(self.current, new_run=True)  # type: ignore[arg-type]
        richer = [log for log in logs if log.run == current.run and log.rank < current.rank]
        if richer:
            self.current = _richest(richer)
        return Choice(self.current)  # type: ignore[arg-type]

    def _training(self, log: LogFile) -> bool:
        """Whether a console log's first bytes hold a training record (looked at again only
        when it was written since, and not once it has one)."""
        seen = self._console.get(log.path)
        if seen is not None and (seen[1] or seen[0] == log.mtime):
            return seen[1]
        try:
            with log.path.open("rb") as file:
                head = file.read(HEAD)
        except OSError:
            return False
        lines = list(text_lines(io.BytesIO(head), []))
        found = any(isinstance(item, StepRecord) for item in UniversalReader().read_lines(lines))
        self._console[log.path] = (log.mtime, found)
        return found
