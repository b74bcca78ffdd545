"""`GenericReader`: the fallback for console logs of ``key: value`` or ``key=value`` pairs.

A line is a record when it holds a step-like key (``step``, ``iter``, ``iteration``,
``global_step``, ``num_updates``) with an integer, and at least one other numeric pair::

    2024-05-01 12:00:00 INFO step=120 loss=2.51 grad_norm=0.83 lr=3e-4
    Epoch 3 | iter: 4500 | train/loss: 2.31 | lr: 0.0003

Names map through the shared aliases (``train/loss`` → ``loss``, ``gnorm`` → ``grad_norm``, ...);
other numeric names pass through unchanged. A line may also read ``step 120/5000``. The reader
cannot know a format's quirks: prefer a specific reader when one fits.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import IO, ClassVar

from stabilizer.core.records import StepRecord

from ._keys import KeyMap
from ._lines import Segments, text_lines
from .base import BaseReader, Item

__all__ = ["GenericReader"]

_STEP_KEYS = ("global_step", "step", "iteration", "iter", "num_updates")  # by priority
_STEP = re.compile(r"\b(?:global_step|step|iteration|iter|num_updates) ?[:=]? ?(\d+)\b")
_PAIR = re.compile(  # a name that starts no later than a word does (the lookbehind keeps it
    # linear on long runs of name characters); possessive: giving characters back never finds a
    # match
    r"([A-Za-z_](?<![\w./-][A-Za-z_])[\w./-]*+) ?[:=] ?"
    r"((?>[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+|nan|inf|NaN|Inf)))(?=[\s,;|)\]]|$)"
)


class GenericReader(BaseReader):
    """Reads any log of ``key: value`` / ``key=value`` pairs with a step (the module doc)."""

    format: ClassVar[str] = "generic"

    @classmethod
    def sniff(cls, head: list[str]) -> float:
        keys = KeyMap()
        hits = sum(1 for line in head if _step_and_values(line, keys) is not None)
        return 0.25 if hits >= 2 else 0.15 if hits else 0.0

    def _items(self, stream: IO[bytes]) -> Iterator[Item]:
        keys, segments = KeyMap(), Segments()
        for lineno, line in enumerate(text_lines(stream, self.notes), 1):
            found = _step_and_values(line, keys)
            if found is None:
                segments.other(line)
                continue
            step, values = found
            restart = segments.restart(step, lineno)
            if restart is not None:
                yield restart
            yield StepRecord(step, values)


def _step_and_values(line: str, keys: KeyMap) -> tuple[int, dict[str, float]] | None:
    """The step and the other values of a line with a step-like key and another number."""
    values = keys.rename(_PAIR.findall(line))
    step = _step(line, values)
    return None if step is None else (step, values)


def _step(line: str, values: dict[str, float]) -> int | None:
    """The step of a line whose named numbers are ``values`` (step keys are popped off them).

    The first of `_STEP_KEYS` there, else ``step 120/5000``-like text; an integer, and only
    beside another value.
    """
    step: float | None = None
    for name in _STEP_KEYS:
        if name in values:
            number = values.pop(name)
            step = number if step is None else step
    if step is None and ("step" in line or "iter" in line):
        match = _STEP.search(line)
        step = float(match.group(1)) if match else None
    if step is None or not values or not math.isfinite(step) or step != int(step):
        return None
    return int(step)
