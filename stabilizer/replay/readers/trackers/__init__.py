"""The stores and exports of experiment trackers: W&B, MLflow, trackio, TensorBoard's downloads.

Files read as logs (`READERS` entries): W&B's run files (`wandb_run`, framed by `leveldb`) and
CSV exports (`wandb_csv`), TensorBoard's downloads (`tensorboard_csv`). Stores of several runs
(`stores`): MLflow's database (`mlflow_db`), ``mlruns/`` tree (`mlflow_files`) and tracking
server (`mlflow_server`), trackio's project file (`trackio_db`), a W&B export of runs side by
side. `rows` makes records of any tracker's rows. How and why: docs/readers.md.
"""

from __future__ import annotations

from collections.abc import Generator

from ..base import Item, LogReadError, Note
from .mlflow_db import MlflowDb
from .mlflow_files import MlflowFiles
from .mlflow_server import MlflowServer
from .stores import Store, address, find_store, open_store, read_items, split_address
from .tensorboard_csv import TensorBoardCsvReader
from .trackio_db import TrackioDb
from .wandb_csv import WandbCsvReader, WandbPanel
from .wandb_run import WandbRunReader

__all__ = [
    "STORES",
    "TensorBoardCsvReader",
    "WandbCsvReader",
    "WandbRunReader",
    "find_tracker",
    "open_tracker",
    "store_addresses",
]

STORES: tuple[type[Store], ...] = (MlflowServer, MlflowFiles, MlflowDb, TrackioDb, WandbPanel)
"""Every kind of store, in the order they are asked whether a location is theirs."""


def find_tracker(
    path: str, format: str = "auto", follow: bool = False
) -> tuple[Store, str | None] | None:
    """The store that ``path`` (``LOCATION#RUN``, or a location) leads to and the run it names,
    to be followed or not; None when it leads to none.

    Raises:
        LogReadError: An ``mlflow:`` URI without the mlflow extra.
    """
    location, key = split_address(path)
    store = find_store(location, STORES, format, follow)
    return None if store is None else (store, key)


def open_tracker(
    path: str, format: str, notes: list[Note]
) -> tuple[str, Generator[Item, None, None]] | None:
    """The format and items of the run that ``path`` leads to in a store, or None when it
    leads to no store.

    Raises:
        LogReadError: The store has no such run, or no run yet.
    """
    found = find_tracker(path, format)
    if found is None:
        return None
    store, key = found
    try:
        run = open_store(store, key, notes)
    except LogReadError:
        store.close()
        raise
    if run is None:
        store.close()
        raise LogReadError(f"{store.location}: {store.what} holds no run yet")
    return store.format, read_items(store, run, notes)


def store_addresses(path: str, format: str = "auto") -> list[str]:
    """Each run of the store that ``path`` leads to (``[]`` for no store, or a path that names
    one run), as `diagnose` takes them: ``LOCATION#RUN``, or a run's own directory."""
    try:
        found = find_tracker(path, format)
        if found is None or found[1] is not None:
            return []
        store = found[0]
        try:
            return [address(store, run) for run in store.runs()]
        finally:
            store.close()
    except LogReadError:  # diagnosing the path says why, once
        return []
