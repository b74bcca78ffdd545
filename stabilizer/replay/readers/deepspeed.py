"""`DeepSpeedReader`: DeepSpeed's fp16 overflow messages and progress lines.

Lines read (with or without the ``[date] [INFO] [file:line:func]`` logging prefix)::

    [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768
    Grad overflow on iteration: 4
    [Rank 0] step=100, skipped=2, lr=[0.0001], mom=[(0.9, 0.999)]
    steps: 100 loss: 2.3456 iter time (s): 0.512 samples/sec: 62.5

An overflow is a skipped step at the attempted scale (the scale in force). Overflow lines carry no
step: the k-th after step P is placed at P + k (``Grad overflow on iteration: I`` gives it exactly,
I + 1; a progress bar glued before it, the HF Trainer's ``94/97976 [...]``, its count). Progress
lines give ``lr``, ``skipped`` 0 and the last known scale. The first rank that prints an overflow
is read, the others' copies not. A message of the trainers' catalogue that reports trouble
(``Current loss scale already at minimum``) is said in a finding (`words`). Why: docs/readers.md.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import IO, ClassVar

from stabilizer.core.records import StepRecord
from stabilizer.core.signals import LOSS, LOSS_SCALE, LR, SKIPPED

from ._lines import Segments, numbered_lines
from .base import BaseReader, Item
from .words import Told

__all__ = ["DeepSpeedReader"]

_NUMBER = r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))"
_OVERFLOW = re.compile(
    r"overflow! (?:Rank (\d+) )?Skipping step\.(?: Attempted loss scale: " + _NUMBER
    + r"(?:, reducing to " + _NUMBER + r")?)?",
    re.IGNORECASE,
)  # fmt: skip
_ITERATION = re.compile(r"Grad overflow on iteration:? (\d+)")
_PROGRESS = re.compile(r"\bstep=(\d+), skipped=(\d+), lr=\[?" + _NUMBER)
_LOSS = re.compile(r"\bsteps: (\d+) loss: " + _NUMBER)
_BAR = re.compile(r"(?<![\w./:-])(\d+)/\d+ \[")  # a tqdm bar's count: "94/97976 [1:27:41<..."
_WEAK = re.compile(r"deepspeed|DeepSpeedEngine|\[Rank \d+\]", re.IGNORECASE)


class DeepSpeedReader(BaseReader):
    """Reads DeepSpeed console logs (see the module docstring)."""

    format: ClassVar[str] = "deepspeed"
    prefixed: ClassVar[bool] = True  # its lines are found with `search`

    @classmethod
    def sniff(cls, head: list[str]) -> float:
        for line in head:
            if _OVERFLOW.search(line) or _PROGRESS.search(line) or _LOSS.search(line):
                return 0.9
        return 0.3 if any(_WEAK.search(line) for line in head) else 0.0

    def _items(self, stream: IO[bytes]) -> Iterator[Item]:
        segments, skips, told = Segments(), _Skips(), Told()
        for lineno, line in numbered_lines(stream, self.notes):
            found = skips.read(line)
            if found is not None:
                if isinstance(found, StepRecord):
                    yield found
                continue
            progress = _PROGRESS.search(line) or _LOSS.search(line)
            if progress is None:
                segments.other(line)
                yield from told.said(line, skips.placed)
                continue
            step = int(progress[1])
            restart = segments.restart(step, lineno)
            if restart is not None:
                yield restart
                skips.placed = step
            values = _values(progress, skips.scale, skips.placed == step)
            skips.placed = max(skips.placed, step)
            yield StepRecord(step, values)


class _Skips:
    """The overflows: where the last was placed, the next one's exact step, the loss scale."""

    def __init__(self) -> None:
        self.placed = 0  # the last step placed (an overflow, or a progress line)
        self.exact: int | None = None  # the step of the next overflow, when a line told it
        self.scale: float | None = None  # the loss scale in force
        self.rank: str | None = None  # the rank whose overflow lines are read: the first

    def read(self, line: str) -> StepRecord | bool | None:
        """A record for an overflow line, True for a line that tells the next one's step."""
        overflow = _OVERFLOW.search(line) if "verflow" in line or "VERFLOW" in line else None
        if overflow is not None and self.rank is None:
            self.rank = overflow.group(1)  # (a pipeline's last stage may print them, not rank 0)
        if overflow is not None and overflow.group(1) in (None, self.rank):
            bar = _BAR.search(line, 0, overflow.start())  # the HF Trainer's bar, glued before it
            exact, placed = int(bar[1]) if bar is not None else self.exact, self.placed
            self.placed = exact if exact is not None and exact > placed else placed + 1
            self.exact, attempted, reduced = None, overflow.group(2), overflow.group(3)
            values = {SKIPPED: 1.0}
            if attempted is not None:  # the attempted scale is the one in force
                values[LOSS_SCALE] = float(attempted)
                self.scale = float(reduced) if reduced is not None else float(attempted)
            return StepRecord(self.placed, values)
        found = _ITERATION.search(line) if "overflow on" in line else None
        if found is not None:
            self.exact = int(found.group(1)) + 1
            return True
        return None


def _values(progress: re.Match[str], scale: float | None, placed: bool) -> dict[str, float]:
    """What a progress line means: its loss (``steps: N loss: x``), or its ``lr``, ``skipped``
    0 unless an overflow was ``placed`` at its step (the step may have been skipped), and the
    last known loss ``scale`` (DeepSpeed does not log its scale growing back)."""
    if progress.re is _LOSS:
        return {LOSS: float(progress[2])}
    values = {LR: float(progress[3])}
    if not placed:
        values[SKIPPED] = 0.0
    if scale is not None:
        values[LOSS_SCALE] = scale
    return values
