"""`follow_store`: a run in a tracker's store (MLflow, trackio, ...) followed for ``watch``.

A store is no file that grows at its end: it is asked, every `STORE_WAIT` seconds at least,
for the rows written since the last look (`trackers.stores.follow_batches`), and hands them to
``watch`` as `feed` hands over a growing file's items: the first look's as the run's history,
later ones as live. A store's location without a run follows its newest run, waiting for one;
a store that appears after the watch began (`mlflow.db` made by the first run) is followed too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .readers import LogReadError, Note
from .readers.trackers import find_tracker
from .readers.trackers.sqlite import MAGIC, is_sqlite
from .readers.trackers.stores import follow_batches

__all__ = ["STORE_WAIT", "follow_store", "is_store_head"]

STORE_WAIT = 0.5
"""Seconds between two looks at a store at least: each look is a query."""


def is_store_head(head: bytes) -> bool:
    """Whether a file's first bytes are a store's (an SQLite database: MLflow's, trackio's)."""
    return head.startswith(MAGIC)


def follow_store(
    path: str,
    format: str,
    notes: list[Note],
    put: Callable[[Any, bool], None],
    *,
    detected: Callable[[str], Any],
    stop: threading.Event,
    poll: float,
) -> bool:
    """Follow ``path`` if it leads to a store, until ``stop`` is set; False when it does not.

    Args:
        path: A store's location, or ``LOCATION#RUN``.
        format: A format name, or ``"auto"``.
        notes: Where the reading leaves its notes.
        put: Hands over a message and whether it is live: ``detected(format)``, then batches
            of items.
        detected: The message that tells the format.
        stop: Set to end the following.
        poll: Seconds between two looks at a file with nothing new (a store waits longer).

    Raises:
        LogReadError: The store cannot be read, has no such run, or is an SQLite file in
            which no tracker's tables appeared before ``stop``.
    """
    found = find_tracker(path, format, follow=True)
    while found is None and is_sqlite(path):  # a database whose writer makes its tables now
        if stop.wait(max(poll, STORE_WAIT)):
            raise LogReadError(f"{path}: no tracker's tables appeared in this database")
        found = find_tracker(path, format, follow=True)
    if found is None:
        return False
    store, key = found
    put(detected(store.format), False)
    live = False
    for batch in follow_batches(store, key, notes, stop, max(poll, STORE_WAIT)):
        if batch:
            put(batch, live)
        live = True
    return True
