"""`Snapshots`: keep the last good training state and roll back to it after a divergence.

A snapshot is the model's and optimizer's ``state_dict`` (and the base optimizer's of a wrapper
that steps through one: SAM's ``state_dict`` does not hold it), the LR scheduler's (optional)
and every random generator's state, so that after `Snapshots.restore` training continues
exactly as it did from the snapshot. Skipping the batches that caused the divergence is up to
the caller (`SkipWindow` keeps count).
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

from stabilizer.live.inner import stepped_through
from stabilizer.live.rng import get_rng_state, set_rng_state

__all__ = ["RollbackError", "Snapshots"]

log = logging.getLogger(__name__)


class RollbackError(RuntimeError):
    """`Snapshots.restore` cannot restore: no snapshot yet, or `max_restores` used up."""


class _Scheduler(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class Snapshots:
    """The last good snapshots of a training run, taken every `every` steps, and their restore.

    The newest `keep` snapshots are held, so that a failure detected late (a divergence is known
    only once the loss has stayed up for a while) can go back to a state from before it began:
    ``restore(before=step)``. A snapshot smaller than `max_memory_bytes` is deep-copied in memory,
    on the tensors' own devices (a CUDA model's copy takes GPU memory, and is fast); a larger one
    is written with ``torch.save`` to ``directory/snapshot-<step>.pt`` (written to a temporary
    name, then renamed) and read back with ``weights_only=True``. Only a finite state is kept: a
    step whose parameters hold NaN/Inf is not snapshotted.

    Args:
        model: The module whose ``state_dict`` is saved.
        optimizer: Its optimizer.
        scheduler: The LR scheduler, or None.
        every: Steps between snapshots (`maybe_save`).
        max_restores: Restores allowed over the run; `restore` refuses after that many.
        directory: Where snapshots over `max_memory_bytes` go; None keeps every one in memory.
        max_memory_bytes: Largest snapshot (tensor bytes) kept in memory; default 1 GiB.
        keep: Snapshots held at once (the oldest is dropped).
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
        keep: int = 1,
    ) -> None:
        if every < 1:
            raise ValueError(f"`every` must be >= 1, got {every}")
        if max_restores < 0:
            raise ValueError(f"`max_restores` must be >= 0, got {max_restores}")
        if max_memory_bytes < 0:
            raise ValueError(f"`max_memory_bytes` must be >= 0, got {max_memory_bytes}")
        if keep < 1:
            raise ValueError(f"`keep` must be >= 1, got {keep}")
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.every, self.max_restores, self.keep = every, max_restores, keep
        self.directory = None if directory is None else Path(directory)
        self.max_memory_bytes = max_memory_bytes
        self.restores = 0
        self._held: list[tuple[int, dict[str, Any] | None]] = []  # (step, state; None: on disk)

    @property
    def step(self) -> int | None:
        """Step of the newest snapshot held; None before the first."""
        return self._held[-1][0] if self._held else None

    @property
    def on_disk(self) -> bool:
        """Whether the newest snapshot held is a file rather than in memory."""
        return bool(self._held) and self._held[-1][1] is None

    @property
    def steps(self) -> list[int]:
        """Steps of the snapshots held, oldest first."""
        return [step for step, _ in self._held]

    def can_restore(self, before: int | None = None) -> bool:
        """Whether `restore` with the same `before` would succeed."""
        return self._pick(before) is not None and self.restores < self.max_restores

    def maybe_save(self, step: int) -> bool:
        """Take a snapshot if `step` is a multiple of `every`; True when one was taken."""
        return step % self.every == 0 and self.save(step)

    def save(self, step: int) -> bool:
        """Take a snapshot now, labelled `step`, unless a parameter is NaN/Inf; True when taken."""
        if not _finite(self.model):
            log.warning("step %d: parameters are not finite, snapshot not taken", step)
            return False
        base = stepped_through(self.optimizer)  # (SAM's base: its state is not in SAM's)
        state = {
            "step": step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "base": None if base is None else base.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "rng": get_rng_state(),
        }
        size = sum(_nbytes(state[k]) for k in ("model", "optimizer", "base") if state[k])
        held: dict[str, Any] | None
        if size <= self.max_memory_bytes or self.directory is None:
            if size > self.max_memory_bytes:
                log.warning("snapshot of %d bytes kept in memory: no `directory` given", size)
            held = copy.deepcopy(state)
        else:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self._path(step).with_suffix(".tmp")
            torch.save(state, tmp)
            os.replace(tmp, self._path(step))  # a crash mid-write leaves no half snapshot
            held = None
        self._drop(lambda s: s == step)
        self._held.append((step, held))
        while len(self._held) > self.keep:
            self._drop(lambda s: s == self._held[0][0])
        return True

    def restore(self, before: int | None = None) -> int:
        """Put a snapshot's weights, optimizer and scheduler state and RNG states back.

        Args:
            before: Restore the newest snapshot taken before this step (the first step of the
                trouble); None: the newest. Newer snapshots are dropped: they hold the trouble.

        Returns:
            The step the snapshot was taken at.

        Raises:
            RollbackError: No snapshot (before `before`) is held, or `max_restores` restores
                were done.
        """
        if self.restores >= self.max_restores:
            raise RollbackError(
                f"refusing to restore: `max_restores` ({self.max_restores}) restores already done"
            )
        picked = self._pick(before)
        if picked is None:
            when = "" if before is None else f" from before step {before}"
            raise RollbackError(f"no snapshot{when} to restore")
        step = self._held[picked][0]
        state = self._load(picked)
        self.model.load_state_dict(state["model"])  # copies into the existing Parameters
        base = stepped_through(self.optimizer)  # (before: loading gives it groups of its own)
        shares_state = base is not None and getattr(self.optimizer, "state", None) is base.state
        self.optimizer.load_state_dict(state["optimizer"])
        if base is not None and state.get("base") is not None:
            base.load_state_dict(state["base"])
            # shared again, as the wrapper made them: an LR written to it reaches its base
            self.optimizer.param_groups = base.param_groups
            if shares_state:
                self.optimizer.state = base.state
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        self.restores += 1
        self._drop(lambda s: s > step)
        return step

    def _pick(self, before: int | None) -> int | None:
        for i in range(len(self._held) - 1, -1, -1):
            if before is None or self._held[i][0] < before:
                return i
        return None

    def _path(self, step: int) -> Path:
        assert self.directory is not None
        return self.directory / f"snapshot-{step}.pt"

    def _drop(self, which: Any) -> None:
        for step, held in [entry for entry in self._held if which(entry[0])]:
            if held is None:
                self._path(step).unlink(missing_ok=True)
        self._held = [entry for entry in self._held if not which(entry[0])]

    def _load(self, index: int) -> dict[str, Any]:
        step, held = self._held[index]
        if held is None:
            state: dict[str, Any] = torch.load(
                self._path(step), map_location="cpu", weights_only=True
            )
            return state
        # The optimizer may keep the loaded tensors as its state and update them in place: hand
        # it copies, so the snapshot survives for the next restore.
        return {**held, "optimizer": copy.deepcopy(held["optimizer"]),
                "base": copy.deepcopy(held.get("base"))}  # fmt: skip


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
