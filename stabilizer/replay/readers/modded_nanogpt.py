"""`ModdedNanoGptReader`: the console output of KellerJordan's modded-nanogpt speedruns.

Lines read::

    step:10/1000 train_loss:7.5000 train_time:1234ms step_avg:nanms
    step:125/1000 val_loss:4.5000 train_time:60000ms step_avg:480.00ms

``step_avg:nanms`` is a timer artefact (the average is undefined over the first, untimed steps),
not a NaN loss: only the ``train_loss`` and ``val_loss`` fields are read. Newer speedruns print no
train loss at all, only ``val_loss`` (which passes through as ``val_loss``, not ``loss``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import IO, ClassVar

from stabilizer.core.records import StepRecord
from stabilizer.core.signals import LOSS

from ._lines import Segments, text_lines
from .base import BaseReader, Item

__all__ = ["ModdedNanoGptReader"]

_STEP = re.compile(
    r"\bstep:(\d+)/\d+ (train_loss|val_loss):([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))"
)
_TIMER = re.compile(r"\bstep:\d+/\d+ train_time:\d")
_KEYS = {"train_loss": LOSS, "val_loss": "val_loss"}


class ModdedNanoGptReader(BaseReader):
    """Reads modded-nanogpt training logs (see the module docstring)."""

    format: ClassVar[str] = "modded_nanogpt"

    @classmethod
    def sniff(cls, head: list[str]) -> float:
        if any(_STEP.search(line) for line in head):
            return 1.0
        return 0.8 if any(_TIMER.search(line) for line in head) else 0.0

    def _items(self, stream: IO[bytes]) -> Iterator[Item]:
        segments = Segments()
        for lineno, line in enumerate(text_lines(stream, self.notes), 1):
            match = _STEP.search(line)
            if match is None:
                segments.other(line)
                continue
            text, name, value = match.groups()
            restart = segments.restart(int(text), lineno)
            if restart is not None:
                yield restart
            yield StepRecord(int(text), {_KEYS[name]: float(value)})
