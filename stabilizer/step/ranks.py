"""`Ranks`: the processes of a run under ``torch.distributed``, and the step's reductions.

Every host runs one process per device in one ``torch.distributed`` process group (Lightning's
strategies, a plain loop's or Fabric's DDP, the HF Trainer's). The step reduces its numbers
across them before it decides, so that every rank takes the same decision and joins the same
collectives: computed once, here, whatever the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from stabilizer.live.probes import GradProbe

__all__ = ["Ranks"]


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run.

    Args:
        world_size: Processes in the run.
        rank: This one's rank.
    """

    world_size: int = 1
    rank: int = 0

    @classmethod
    def current(cls) -> Ranks:
        """The default process group's, or one process when there is none."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        return cls(dist.get_world_size(), dist.get_rank())

    def mean(self, vec: torch.Tensor) -> torch.Tensor:
        """The mean over ranks: a NaN anywhere makes it NaN everywhere, so all decide alike."""
        return self.sum(vec) / self.world_size if self.world_size > 1 else vec

    def reduce(self, vec: torch.Tensor, norms: int, sharded: bool = False) -> torch.Tensor:
        """A step's numbers over all ranks: the mean, but where each rank holds a shard of every
        gradient (FSDP) the first `norms` entries (gradient norms, partial) sum as squares."""
        if not sharded:
            return self.mean(vec)
        squares = self.sum(GradProbe.sharded_squares(vec[:norms]))
        return torch.cat((GradProbe.from_squares(squares), self.mean(vec[norms:])))

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (every rank calls it, or none)."""
        if self.world_size <= 1:
            return value
        out = value.clone()
        dist.all_reduce(out)
        return out

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order."""
        if self.world_size <= 1:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)  # our own processes' objects, never a log's
        return gathered
