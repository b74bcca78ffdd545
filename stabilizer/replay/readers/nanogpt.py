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

from ._lines import resume_banner, text_chunks
from .base import BaseReader, record

__all__ = ["NanoGptReader"]

_NUMBER = r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))"
# ``\biter`` as a lookbehind after the literal: the same matches, found by a fast literal scan.
_ITER = re.compile(r"iter (?<!\witer )(\d+): loss " + _NUMBER)
_EVAL = re.compile(r"step (?<!\wstep )(\d+): train loss " + _NUMBER + r", val loss " + _NUMBER)
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

    def _records(self, stream: IO[bytes]) -> Iterator[StepRecord]:
        last, banner, base = -1, "", 1
        search_iter, search_eval = _ITER.search, _EVAL.search
        for lines in text_chunks(stream, self.notes):
            for lineno, line in enumerate(lines, base):
                if (match := search_iter(line)) is not None:
                    step, values = int(match[1]), {LOSS: float(match[2])}
                elif (match := search_eval(line)) is not None:
                    step = int(match[1])
                    values = {"eval_train_loss": float(match[2]), "val_loss": float(match[3])}
                else:
                    if last >= 0 and not banner:
                        banner = resume_banner(line)
                    continue
                if step < last or banner:
                    self.segment(step, last, banner, lineno)
                    banner = ""
                last = step
                yield record(step, values)
            base += len(lines)
