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

from ._lines import resume_banner, text_chunks
from .base import BaseReader, record

__all__ = ["ModdedNanoGptReader"]

_STEP = re.compile(  # ``\bstep:`` as a lookbehind after the literal: a fast literal scan
    r"step:(?<!\wstep:)(\d+)/\d+ (train_loss|val_loss):"
    r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))"
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

    def _records(self, stream: IO[bytes]) -> Iterator[StepRecord]:
        last, banner, search, base = -1, "", _STEP.search, 1
        for lines in text_chunks(stream, self.notes):
            for lineno, line in enumerate(lines, base):
                match = search(line)
                if match is None:
                    if last >= 0 and not banner:
                        banner = resume_banner(line)
                    continue
                text, name, value = match.groups()
                step = int(text)
                if step < last or banner:
                    self.segment(step, last, banner, lineno)
                    banner = ""
                last = step
                yield record(step, {_KEYS[name]: float(value)})
            base += len(lines)
