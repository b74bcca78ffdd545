"""`MegatronReader`: the ``iteration N/ M | ... |`` lines of Megatron-LM (and Megatron-DeepSpeed).

A line (new layouts prefix a ``[2024-05-01 12:00:00]`` timestamp; old ones carry other fields)::

     iteration     1200/   50000 | consumed samples: ... | learning rate: 3.000E-04 | global
     batch size:   512 | lm loss: 3.141593E+00 | loss scale: 4096.0 | grad norm: 0.500 |
     number of skipped iterations:   0 | number of nan iterations:   0 |

Quirks: the losses are averages over the log interval (default 100 iterations), so the record
sits at the interval's last iteration and a one-step spike is diluted; the grad norm is the last
iteration's. An average that is NaN (or not positive) is left off the line; the interval's
``number of nan iterations`` still counts it, so nan iterations > 0 make the loss NaN.
Skipped iterations > 0 make ``skipped`` 1 (the fp16 scaler, or the NaN skip, fired in the
interval); the counts themselves pass through as ``skipped_iterations`` and ``nan_iterations``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import IO, ClassVar

from ..records import StepRecord
from ..signals import GRAD_NORM, LOSS, LOSS_SCALE, LR, SKIPPED
from ._lines import labels, pick, resume_banner, text_lines
from .base import BaseReader, record

__all__ = ["MegatronReader"]

_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\|")
_FIELDS = labels(
    {
        "| lm loss:": LOSS,
        "| loss scale:": LOSS_SCALE,
        "| grad norm:": GRAD_NORM,
        "| learning rate:": LR,
        "| number of skipped iterations:": "skipped_iterations",
        "| number of nan iterations:": "nan_iterations",
    }
)
_WEAK = re.compile(r"- arguments -|> building \w+ model|using world size:|megatron", re.I)


class MegatronReader(BaseReader):
    """Reads Megatron-LM console logs; one record per logged interval (see the module doc)."""

    format: ClassVar[str] = "megatron"

    @classmethod
    def sniff(cls, head: list[str]) -> float:
        if any(_ITERATION.search(line) and "|" in line for line in head):
            return 1.0
        return 0.4 if any(_WEAK.search(line) for line in head) else 0.0

    def _records(self, stream: IO[bytes]) -> Iterator[StepRecord]:
        last, banner, interval = -1, "", 0
        for lineno, line in enumerate(text_lines(stream, self.notes), 1):
            match = _ITERATION.search(line)
            if match is None:
                if last >= 0 and not banner:
                    banner = resume_banner(line)
                continue
            step = int(match.group(1))
            values = _values(line, match.end() - 1)
            if step < last or banner:
                self.segment(step, last, banner, lineno)
                banner = ""
            elif not interval and 0 <= last < step:
                interval = step - last
                self._note_interval(interval, lineno)
            last = step
            yield record(step, values)

    def _note_interval(self, interval: int, lineno: int) -> None:
        self.note(
            "format",
            f"Megatron losses are averages over the log interval of {interval} iterations, "
            "each recorded at the interval's last iteration: short spikes are diluted",
            lineno,
        )


def _values(line: str, start: int) -> dict[str, float]:
    values = pick(line, start, _FIELDS, "|")
    if values.get("nan_iterations", 0.0) > 0:
        values[LOSS] = math.nan
    skipped = values.get("skipped_iterations")
    if skipped is not None:
        values[SKIPPED] = 1.0 if skipped > 0 else 0.0
    return values
