"""The log in a run directory: which format, which files (those of the newest run).

The walk goes up to `DEPTH` levels down and skips hidden directories. It visits each real
directory once, so a link back up (``d/up -> ..``) or many links to one directory cost one visit,
and it follows a symbolic link only when the link leads somewhere inside the given directory.
Event files that ``stabilizer diagnose --tensorboard`` wrote (their names end in
`REPLAY_SUFFIX`) are not read beside the run's own.
"""

from __future__ import annotations

import os
from fnmatch import fnmatchcase
from pathlib import Path

from .base import LogReadError, Note, add_note

__all__ = ["DEPTH", "KINDS", "REPLAY_SUFFIX", "find_logs", "find_runs"]

DEPTH = 4  # directory levels looked into below the given one

KINDS = (  # what a directory may hold, most complete first: (format, file name pattern)
    ("jsonl", "stability.jsonl"),
    ("tensorboard", "events.out.tfevents.*"),
    ("wandb", "run-*.wandb"),  # a W&B run folder: wandb/run-*, wandb/offline-run-*
    ("lightning_csv", "metrics.csv"),
    ("hf_trainer_state", "trainer_state.json"),
)

REPLAY_SUFFIX = ".stabilizer-replay"
"""Ends the name of an event file that ``stabilizer diagnose --tensorboard`` wrote: a replay of
another log. In a run directory that holds other event files too, replays are not read."""


def find_logs(directory: Path, format: str, notes: list[Note]) -> tuple[str, list[Path]]:
    """The format and files of the log in a run directory (the newest run when there are several).

    Raises:
        LogReadError: Nothing readable in ``directory``.
    """
    kinds = [kind for kind in KINDS if format in ("auto", kind[0])]
    if not kinds:
        valid = ", ".join(kind for kind, _ in KINDS)
        raise LogReadError(f"{directory}: a directory reads as {valid}, not {format}: pass a file")
    walk = _Walk(directory, [pattern for _, pattern in kinds])
    if walk.outside:
        why = f"{walk.outside} symbolic link(s) leading out of {directory} not followed"
        add_note(notes, Note("source", why))
    for kind, pattern in kinds:
        found = _originals([path for path in walk.found if fnmatchcase(path.name, pattern)], notes)
        if not found:
            continue
        runs = sorted({p.parent for p in found}, key=_mtime)
        if len(runs) > 1:
            why = f"{len(runs)} runs in {directory}: reading the newest, {runs[-1]}"
            notes.append(Note("source", why))
        files = [p for p in found if p.parent == runs[-1]]
        notes.append(Note("source", f"reading {kind}: {', '.join(p.name for p in files)}"))
        return kind, files
    looked = ", ".join(pattern for _, pattern in kinds)
    raise LogReadError(f"{directory}: nothing readable in this directory (looked for {looked})")


def find_runs(directory: Path, format: str = "auto") -> list[Path]:
    """Every run directory under ``directory``, in path order: the directories holding a log of
    the most complete kind found (`KINDS`), as `find_logs` would choose among them; ``[]`` when
    nothing is readable (`find_logs` then says why)."""
    kinds = [kind for kind in KINDS if format in ("auto", kind[0])]
    walk = _Walk(directory, [pattern for _, pattern in kinds])
    for _, pattern in kinds:
        found = _originals([path for path in walk.found if fnmatchcase(path.name, pattern)], [])
        if found:
            return sorted({path.parent for path in found})
    return []


def _originals(found: list[Path], notes: list[Note]) -> list[Path]:
    """``found`` less the replays among them, unless there is nothing else."""
    originals = [path for path in found if not path.name.endswith(REPLAY_SUFFIX)]
    if not originals or len(originals) == len(found):
        return found
    skipped = len(found) - len(originals)
    add_note(notes, Note("source", f"{skipped} replay(s) by `stabilizer diagnose` not read"))
    return originals


class _Walk:
    """The regular files whose names match ``patterns``, found as the module docstring says."""

    def __init__(self, root: Path, patterns: list[str]) -> None:
        self.patterns = patterns
        self.found: list[Path] = []
        self.outside = 0  # symbolic links not followed
        self._top = root.resolve()
        self._seen: set[tuple[int, int]] = set()  # (device, inode) of the directories visited
        self._visit(root, DEPTH)
        self.found.sort()

    def _visit(self, directory: Path, depth: int) -> None:
        try:
            info = directory.stat()
            if (info.st_dev, info.st_ino) in self._seen:
                return
            self._seen.add((info.st_dev, info.st_ino))
            with os.scandir(directory) as listing:
                # a link is a second name: the real one first (wandb/latest-run is a run's)
                entries = sorted(listing, key=lambda entry: (entry.is_symlink(), entry.name))
        except OSError:  # unreadable, or gone: nothing to find there
            return
        for entry in entries:
            path = Path(entry.path)
            if entry.is_symlink() and not self._inside(path):
                if self._wanted(entry.name) or _is_dir(entry):  # (W&B's debug-core.log: no log)
                    self.outside += 1
            elif _is_dir(entry):
                if depth > 0 and not entry.name.startswith("."):
                    self._visit(path, depth - 1)
            elif self._wanted(entry.name) and _is_file(entry):
                self.found.append(path)

    def _wanted(self, name: str) -> bool:
        return any(fnmatchcase(name, pattern) for pattern in self.patterns)

    def _inside(self, link: Path) -> bool:
        try:
            target = link.resolve(strict=True)
        except (OSError, RuntimeError):  # dangling, or a loop of links
            return False
        return target == self._top or self._top in target.parents


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def _is_file(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_file()
    except OSError:
        return False


def _mtime(directory: Path) -> tuple[float, str]:
    """When the run in ``directory`` last wrote a file (0 when that cannot be told)."""
    try:
        with os.scandir(directory) as listing:
            times = [entry.stat().st_mtime for entry in listing if _is_file(entry)]
    except OSError:
        times = []
    return (max(times, default=0.0), str(directory))
