"""`DeepSpeedReader`: DeepSpeed's fp16 overflow messages and progress lines.

Lines read (with or without the ``[date] [INFO] [file:line:func]`` logging prefix)::

    [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768
    [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 4096, but hysteresis is 2.
        Reducing hysteresis to 1
    [deepspeed] fp16 dynamic loss scale overflow! Skipping step. Attempted loss scale: ...
    Grad overflow on iteration: 4
    [Rank 0] step=100, skipped=2, lr=[0.0001], mom=[(0.9, 0.999)]
    steps: 100 loss: 2.3456 iter time (s): 0.512 samples/sec: 62.5

An overflow is a skipped step: a record with ``skipped`` 1 and ``loss_scale`` the attempted scale
(the scale in force, as the live monitor records it); the scale then drops (or, under
hysteresis, holds). Overflow lines carry no step: DeepSpeed counts skipped steps in its global
step and reports ``step=N`` every ``steps_per_print`` steps, so the k-th overflow after step P is
placed at step P + k (a lower bound; ``Grad overflow on iteration: I`` gives it exactly, I + 1).
Progress lines give ``lr``, ``skipped`` 0 and the last known scale (DeepSpeed does not log its
scale growing back), so the `fp16_overflow` detector sees good steps between overflows. Other
ranks' overflow lines are ignored.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import IO, ClassVar

from ..records import StepRecord
from ..signals import LOSS, LOSS_SCALE, LR, SKIPPED
from ._lines import resume_banner, text_lines
from .base import BaseReader, record

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
_WEAK = re.compile(r"deepspeed|DeepSpeedEngine|\[Rank \d+\]", re.IGNORECASE)


class DeepSpeedReader(BaseReader):
    """Reads DeepSpeed console logs (see the module docstring)."""

    format: ClassVar[str] = "deepspeed"

    @classmethod
    def sniff(cls, head: list[str]) -> float:
        for line in head:
            if _OVERFLOW.search(line) or _PROGRESS.search(line) or _LOSS.search(line):
                return 0.9
        return 0.3 if any(_WEAK.search(line) for line in head) else 0.0

    def _records(self, stream: IO[bytes]) -> Iterator[StepRecord]:
        last, placed, scale, banner = -1, 0, None, ""  # last reported step; last placed step
        exact: int | None = None
        for lineno, line in enumerate(text_lines(stream, self.notes), 1):
            overflow = _OVERFLOW.search(line) if "VERFLOW" in line or "verflow" in line else None
            if overflow is not None and overflow.group(1) in (None, "0"):
                placed = exact if exact is not None and exact > placed else placed + 1
                exact, attempted, reduced = None, overflow.group(2), overflow.group(3)
                values = {SKIPPED: 1.0}
                if attempted is not None:
                    values[LOSS_SCALE] = float(attempted)
                    scale = float(reduced) if reduced is not None else float(attempted)
                yield record(placed, values)
                continue
            found = _ITERATION.search(line) if "overflow on" in line else None
            if found is not None:
                exact = int(found.group(1)) + 1
                continue
            progress = (_PROGRESS.search(line) or _LOSS.search(line)) if "step" in line else None
            if progress is None:
                if last >= 0 and not banner:
                    banner = resume_banner(line)
                continue
            step = int(progress.group(1))
            if step < last or banner:
                self.segment(step, last, banner, lineno)
                placed, banner = step, ""
            values = _values(progress, scale)
            if placed == step:  # an overflow was placed here: the step may have been skipped
                values.pop(SKIPPED, None)
            last, placed = step, max(placed, step)
            yield record(step, values)


def _values(progress: re.Match[str], scale: float | None) -> dict[str, float]:
    if progress.re is _LOSS:
        return {LOSS: float(progress.group(2))}
    values = {LR: float(progress.group(3)), SKIPPED: 0.0}
    if scale is not None:
        values[LOSS_SCALE] = scale
    return values
