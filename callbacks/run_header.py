"""`run_header`: the facts of a Lightning run that ``stability.jsonl`` opens with.

The replayed report needs what the live monitor knows from the Trainer (an fp32 run gets no fp32
islands as advice): the precision, where it trains, the strategy, the policy, the depth groups
and the monitor's version, as one `stabilizer.core.run.RunHeader`.
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as pl

from stabilizer import __version__
from stabilizer.core.run import RunHeader

__all__ = ["run_header"]


def run_header(trainer: pl.Trainer, policy: str, groups: Sequence[str]) -> RunHeader:
    """The run's facts as the Trainer tells them (Lightning's own names for each)."""
    accelerator = type(trainer.accelerator).__name__.removesuffix("Accelerator").lower()
    return RunHeader(
        precision=str(trainer.precision),
        accelerator=accelerator,
        devices=max(1, int(trainer.num_devices)),
        strategy=type(trainer.strategy).__name__,
        world_size=max(1, int(trainer.world_size)),
        policy=policy,
        groups=tuple(groups),
        version=__version__,
    )
