"""Stores that keep several runs (a tracker's database, a W&B export of runs side by side), and
their runs as item streams.

A `Store` is found at a location (`STORES`, the first whose `Store.at` claims it): an MLflow
``mlflow.db`` or ``mlruns/`` tree, an ``mlflow:<tracking URI>``, a trackio project's ``.db``, a W&B
panel export. It lists its runs (`Store.runs`, oldest first) and hands out a run's rows since a
cursor (`Store.rows`): all of them once for ``diagnose`` (`read_items`), what is new at each look
for ``watch`` (`follow_batches`). Rows become records through `TrackerRows`.

One run of a store is written ``LOCATION#RUN`` (`address`): ``mlflow.db#<run id>``,
``demo.db#<run name>``; a run of an ``mlruns/`` tree is its own directory. A location without a
run reads its newest run, with a note, as a directory of runs does; ``stabilizer diagnose``
reports each run (`store_addresses`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..base import Item, LogReadError, Note, add_note
from .rows import TrackerRows

__all__ = [
    "PAGE",
    "Row",
    "Run",
    "Store",
    "address",
    "find_store",
    "follow_batches",
    "open_store",
    "read_items",
    "split_address",
]

PAGE = 10_000
"""Rows a store hands out at once at most: memory stays bounded whatever the run's length."""

Row = tuple[int | None, dict[str, float]]
"""A row of a run: the tracker's step (None when it has none) and the numbers logged."""


@dataclass(frozen=True)
class Run:
    """One run of a store.

    Args:
        key: What names it in its store: a run id, a run name, a directory.
        label: What a person calls it (its name), for the notes.
        path: Its own path, where it has one (a run of an ``mlruns/`` tree): its address.
    """

    key: str
    label: str
    path: str = ""


class Store:
    """A location holding runs; subclasses claim their locations and read their rows.

    Args:
        location: The file, directory or URI it is at.
    """

    format: ClassVar[str] = ""
    what: ClassVar[str] = ""  # what it is, in messages ("this MLflow store")

    def __init__(self, location: str) -> None:
        self.location = location

    @classmethod
    def at(cls, location: str, follow: bool = False) -> Store | None:
        """The store at ``location``, or None when it is none of this kind (a cheap look);
        ``follow``: it will be asked again as it grows (``watch``)."""
        raise NotImplementedError

    def runs(self) -> list[Run]:
        """Its runs, oldest first."""
        raise NotImplementedError

    def rows(self, run: Run, cursor: Any) -> tuple[list[Row], Any]:
        """The rows of ``run`` after ``cursor`` (None: from the start), in log order, at most
        `PAGE` of them, and the cursor after them (none: nothing new yet)."""
        raise NotImplementedError

    def close(self) -> None:
        """Let go of what it holds open."""


def address(store: Store, run: Run) -> str:
    """How one run of ``store`` is written: its own path, else ``LOCATION#KEY``."""
    return run.path or f"{store.location}#{run.key}"


def split_address(path: str) -> tuple[str, str | None]:
    """``LOCATION#RUN`` as ``(LOCATION, RUN)`` where it names a run (a file named so wins);
    else ``(path, None)``."""
    location, mark, run = path.rpartition("#")
    if not mark or not location or not run or _exists(path):
        return path, None
    if location.startswith("mlflow:") or _exists(location):
        return location, run
    return path, None


def _exists(path: str) -> bool:
    try:
        return Path(path).exists()
    except OSError:
        return False


def find_store(
    location: str, stores: Sequence[type[Store]], format: str, follow: bool = False
) -> Store | None:
    """The store at ``location`` of the first kind of ``stores`` that claims it (of ``format``
    unless it is ``"auto"``), to be followed or not."""
    for kind in stores:
        if format in ("auto", kind.format):
            store = kind.at(location, follow)
            if store is not None:
                return store
    return None


def open_store(store: Store, key: str | None, notes: list[Note]) -> Run | None:
    """The run of ``store`` named ``key`` (its newest when None: with a note if it has more;
    None if it has none yet).

    Raises:
        LogReadError: It has no run of that key.
    """
    runs = store.runs()
    if key is None:
        if len(runs) > 1:
            why = f"{len(runs)} runs in {store.location}: reading the newest, {runs[-1].label}"
            add_note(notes, Note("source", why))
        key = runs[-1].key if runs else None
        if key is None:
            return None
    for run in runs:
        if key in (run.key, run.label):
            named = run.label if run.label == run.key else f"{run.label} ({run.key})"
            add_note(notes, Note("source", f"run {named} of {store.location}"))
            return run
    known = ", ".join(run.key for run in runs[:10]) or "none"
    raise LogReadError(f"{store.location}: no run {key!r} in {store.what} (runs: {known})")


def read_items(store: Store, run: Run, notes: list[Note]) -> Generator[Item, None, None]:
    """Every item of ``run``, once; the store is closed at the end."""
    try:
        rows, cursor, more = TrackerRows(_noter(store, notes)), None, True
        while more:
            fetched, cursor = store.rows(run, cursor)
            for own, row in fetched:
                yield from rows.add(own, row)
            more = len(fetched) >= PAGE
        yield from rows.done()
    finally:
        store.close()


def follow_batches(
    store: Store, key: str | None, notes: list[Note], stop: threading.Event, wait: float
) -> Iterator[list[Item]]:
    """The items of a growing run, a batch per look (empty when nothing came), every ``wait``
    seconds until ``stop`` is set. Without ``key``, the newest run, waiting for one to appear;
    a newer run that begins is followed from its start, after a `Restart`."""
    rows, cursor, run = TrackerRows(_noter(store, notes)), None, None
    try:
        while not stop.is_set():
            batch: list[Item] = []
            newest = open_store(store, key, []) if run is None or key is None else run
            if newest is not None and newest != run:
                named = f"{newest.label} of {store.location}"
                add_note(notes, Note("source", f"run {named}" if run is None else f"now {named}"))
                if run is not None:  # a newer run began: the old one is done
                    batch += rows.done()
                    rows = TrackerRows(_noter(store, notes), f"run {newest.label} began")
                run, cursor = newest, None
            more = run is not None
            while more and run is not None:
                fetched, cursor = store.rows(run, cursor)
                for own, row in fetched:
                    batch += rows.add(own, row)
                more = len(fetched) >= PAGE
            batch += rows.flush()  # the last step is complete as far as anyone knows
            yield batch
            stop.wait(wait)
        yield rows.done()
    finally:
        store.close()


def _noter(store: Store, notes: list[Note]) -> Callable[[str, str], None]:
    def note(kind: str, message: str) -> None:
        add_note(notes, Note(kind, message))

    return note
