"""`Snapshots`: keep the last good training state and roll back to it after a divergence.

A snapshot is the model's and optimizer's ``state_dict``, the LR scheduler's (optional) and every
random generator's state, so that after `Snapshots.restore` training continues exactly as it did
from the snapshot. Skipping the batches that caused the divergence is up to the caller
(`SkipWindow` keeps count).
"""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from ._rng import get_rng_state, set_rng_state

__all__ = ["RollbackError", "Snapshots"]

log = logging.getLogger(__name__)

_FILE = "snapshot.pt"


class RollbackError(RuntimeError):
    """`Snapshots.restore` cannot restore: no snapshot yet, or `max_restores` used up."""


class _Scheduler(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class Snapshots:
    """The last good snapshot of a training run, taken every `every` steps, and its restore.

    A snapshot smaller than `max_memory_bytes` is deep-copied in memory, on the tensors' own
    devices (a CUDA model's copy takes GPU memory, and is fast); a larger one is written with
    ``torch.save`` to ``directory/snapshot.pt`` (one file, replaced atomically) and read back with
    ``weights_only=True``. Only a finite state is kept: a step whose parameters hold NaN/Inf is
    not snapshotted, so the one held is always the last finite one.

    Args:
        model: The module whose ``state_dict`` is saved.
        optimizer: Its optimizer.
        scheduler: The LR scheduler, or None.
        every: Steps between snapshots (`maybe_save`).
        max_restores: Restores allowed over the run; `restore` refuses after that many.
        directory: Where snapshots over `max_memory_bytes` go; None keeps every one in memory.
        max_memory_bytes: Largest snapshot (tensor bytes) kept in memory; default 1 GiB.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        scheduler: _Scheduler | None = None,
        *,
        every: int = 100,
        max_restores: int = 3,
        directory: str | os.PathLike[str] | None = None,
        max_memory_bytes: int = 1 << 30,
    ) -> None:
        if every < 1:
            raise ValueError(f"`every` must be >= 1, got {every}")
        if max_restores < 0:
            raise ValueError(f"`max_restores` must be >= 0, got {max_restores}")
        if max_memory_bytes < 0:
            raise ValueError(f"`max_memory_bytes` must be >= 0, got {max_memory_bytes}")
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.every, self.max_restores = every, max_restores
        self.directory = None if directory is None else Path(directory)
        self.max_memory_bytes = max_memory_bytes
        self.step: int | None = None  # step of the snapshot held; None before the first
        self.on_disk = False  # whether the snapshot held is the file rather than `_memory`
        self.restores = 0
        self._memory: dict[str, Any] | None = None

    @property
    def can_restore(self) -> bool:
        """Whether `restore` would succeed."""
        return self.step is not None and self.restores < self.max_restores

    def maybe_save(self, step: int) -> bool:
        """Take a snapshot if `step` is a multiple of `every`; True when one was taken."""
        return step % self.every == 0 and self.save(step)

    def save(self, step: int) -> bool:
        """Take a snapshot now, labelled `step`, unless a parameter is NaN/Inf; True when taken."""
        if not _finite(self.model):
            log.warning("step %d: parameters are not finite, snapshot not taken", step)
            return False
        state = {
            "step": step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "rng": get_rng_state(),
        }
        size = _nbytes(state["model"]) + _nbytes(state["optimizer"])
        if size <= self.max_memory_bytes or self.directory is None:
            if size > self.max_memory_bytes:
                log.warning("snapshot of %d bytes kept in memory: no `directory` given", size)
            self._memory, self.on_disk = copy.deepcopy(state), False
        else:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / f"{_FILE}.tmp"
            torch.save(state, tmp)
            os.replace(tmp, self.directory / _FILE)  # a crash mid-write keeps the old snapshot
            self._memory, self.on_disk = None, True
        self.step = step
        return True

    def restore(self) -> int:
        """Put the snapshot's weights, optimizer and scheduler state and RNG states back.

        Returns:
            The step the snapshot was taken at.

        Raises:
            RollbackError: No snapshot was taken yet, or `max_restores` restores were done.
        """
        if self.step is None:
            raise RollbackError("no snapshot to restore: none was taken yet")
        if self.restores >= self.max_restores:
            raise RollbackError(
                f"refusing to restore: `max_restores` ({self.max_restores}) restores already done"
            )
        state = self._load()
        self.model.load_state_dict(state["model"])  # copies into the existing Parameters
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        self.restores += 1
        return int(state["step"])

    def _load(self) -> dict[str, Any]:
        if self.on_disk:
            assert self.directory is not None
            path = self.directory / _FILE
            state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
            return state
        assert self._memory is not None
        # The optimizer may keep the loaded tensors as its state and update them in place: hand
        # it copies, so the snapshot survives for the next restore.
        return {**self._memory, "optimizer": copy.deepcopy(self._memory["optimizer"])}


def _finite(model: nn.Module) -> bool:
    flags = [p.detach().isfinite().all() for p in model.parameters()]
    if not flags:
        return True
    # One device sync, not one per tensor; a model split over devices gathers on the first.
    return bool(torch.stack([flag.to(flags[0].device) for flag in flags]).all())


def _nbytes(obj: object) -> int:
    """Bytes of the tensors in a nested ``state_dict``."""
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_nbytes(v) for v in obj)
    return 0
