"""`NanoGptReader`: the console output of Karpathy's nanoGPT ``train.py``.

Lines read::

    iter 100: loss 2.3456, time 12.34ms, mfu 30.00%
    step 100: train loss 2.3000, val loss 2.4000

The ``iter`` loss is the last micro-batch's loss times the accumulation steps (an estimate of the
step's loss), printed every ``log_interval`` iterations. The eval line's losses are means over
``eval_iters`` batches: they pass through as ``eval_train_loss`` and ``val_loss``, not as
``loss``. ``Resuming training from <dir>`` starts a new segment.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import IO, ClassVar

from stabilizer.core.records import StepRecord
from stabilizer.core.signals import LOSS

from ._lines import Segments, text_lines
from .base import BaseReader, Item

__all__ = ["NanoGptReader"]

_NUMBER = r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))"
_ITER = re.compile(r"\biter (\d+): loss " + _NUMBER)
_EVAL = re.compile(r"\bstep (\d+): train loss " + _NUMBER + r", val loss " + _NUMBER)
_WEAK = re.compile(
    r"tokens per iteration will be|Initializing a new model from scratch|found vocab"
)


class NanoGptReader(BaseReader):
    """Reads nanoGPT training logs (see the module docstring)."""

    format: ClassVar[str] = "nanogpt"

    @classmethod
    def sniff(cls, head: list[str]) -> float:
        if any(_ITER.search(line) for line in head):
            return 0.9
        if any(_EVAL.search(line) for line in head):
            return 0.85
        return 0.5 if any(_WEAK.search(line) for line in head) else 0.0

    def _items(self, stream: IO[bytes]) -> Iterator[Item]:
        segments = Segments()
        for lineno, line in enumerate(text_lines(stream, self.notes), 1):
            found = _step_values(line)
            if found is None:
                segments.other(line)
                continue
            restart = segments.restart(found[0], lineno)
            if restart is not None:
                yield restart
            yield StepRecord(*found)


def _step_values(line: str) -> tuple[int, dict[str, float]] | None:
    """The step and values of an ``iter`` line (the loss) or an eval line (its two means, which
    are not the step's loss); None for any other line."""
    match = _ITER.search(line)
    if match is not None:
        return int(match[1]), {LOSS: float(match[2])}
    match = _EVAL.search(line)
    if match is not None:
        return int(match[1]), {"eval_train_loss": float(match[2]), "val_loss": float(match[3])}
    return None
