"""Where a console line is: its step, from the counters it prints and the epoch it is in.

`COUNTERS` is the one list of counter names: the step regex, the cheap test that a line may hold
one, the names that are never a metric (`STEP_NAMES`) and the names that head a table all come
from it. The rules for the step (a named counter, ESPnet's batch range, a count ``n/N`` after an
epoch, in a bar or in brackets, a count first on the line, else the epoch; counts within an epoch
count on across epochs) are in docs/readers.md.
"""

from __future__ import annotations

import re
from functools import cache
from typing import NamedTuple

__all__ = ["COUNTERS", "STEP_NAMES", "Counter", "Steps", "counted_by", "counter_spans"]


class Counter(NamedTuple):
    """A counter a log names its step by.

    Args:
        name: As printed, lower case.
        pattern: How the step regex spells it, when not just the name.
        needs: Text every line that prints it holds, when not just the name.
    """

    name: str
    pattern: str = ""
    needs: str = ""


COUNTERS = (  # of two counters on a line, the earlier in this list is the step
    Counter("global_step"),
    Counter("total_step"),
    Counter("step", r"step(?:s(?=\s*:))?"),  # "Steps : 9", but not "steps = 9"
    Counter("num_updates"),
    Counter("update", r"update(?:s(?=\s*[:=]))?"),  # Sockeye's "Updates=440000"
    Counter("up.", r"up\."),  # Marian's "Up. 14000"
    Counter("iteration"),
    Counter("iter"),
    Counter("batch"),
    Counter("s", r"s(?=:\d)", needs="s:"),  # llm.c's "s:12"
)
"""The counters of the step, in the order that wins (``iter 8 step 1`` is step 1)."""

STEP_NAMES = frozenset((*(counter.name for counter in COUNTERS), "steps", "updates", "epoch"))
"""Names that say where a record is and are none of its values (the plurals ``Steps`` and
``Updates`` and the epoch too): a table of these first, a ``| name | value |`` row of them, is
the step."""

_KEYED = frozenset(
    name + plural
    for name in (counter.name for counter in COUNTERS if len(counter.name) > 2)
    if name != "batch"  # ("time/batch" is a duration)
    for plural in ("", "s")
)
"""The last part of a key's path that names a counter (``counters/updates``: the updates)."""

_NEEDS = [counter.needs or counter.name for counter in COUNTERS]
_NEEDED = tuple(dict.fromkeys(t for t in _NEEDS if not any(o != t and o in t for o in _NEEDS)))
"""The texts a line must hold one of to print a counter (``step`` covers ``global_step``)."""

_STEP = re.compile(  # each name starts a word: a lookbehind after its first letter (fast scans)
    "("
    + "|".join(
        rf"{p[0]}(?<![\w./-]{p[0]}){p[1:]}"
        for p in (counter.pattern or re.escape(counter.name) for counter in COUNTERS)
    )
    + r")(?:/(?:max|total)_\w+)?(?:\(train\))?['\"\]]?\s*[:=#]?\s*['\"]?[\[(]?\s*(\d+)"
    + r"(?:\s*/\s*(\d+))?[\])]?(?![\w%]|\.\w)"  # "1%" and "1.5" are none; "{'step': 5}" (a
)  # dict's key), "Step: 121505. Epoch: 262", ms-swift's "'global_step/max_steps': '5/9'", ST-GCN's
# "Batch(100/1879) done." are one
_RANGE = re.compile(r"\d+-(\d+)batch\b")  # ESPnet: the batches a summary line covers
_EPOCH = re.compile(
    r"(?<![\w./-])epoch(?:\(train\))?['\"]?\s*[:=#]?\s*\[?\s*(\d+)(?![\d.])\]?(?:\s*/\s*(\d+))?"
)
_AFTER_EPOCH = re.compile(  # "Epoch 3/10 [120/500]", "Epoch:[0/2](7000/293491)"
    r"[\s,:;|\]]*[\[(]?\s*(\d+)\s*/\s*(\d+)(?![\w.])"
)
_BAR = re.compile(r"(?<![\w./:-])(\d+)/(\d+) \[")
_LEADING = re.compile(  # "420 | x", "[  3]  2210 || B:", Dreamer's "[5000] expl_amount 0.0 / ..."
    r"\s*(?:(?:\[\s*\d+\s*\]\s+)?(\d+)\s*\|\|?\s|\[(\d+)\]\s+[a-z_]+\s+-?\d)"
)
_BRACKET = re.compile(r"\[\s*(\d+)\s*/\s*(\d+)\s*(?:\(\s*\d+%\)\s*)?\]")
_BRACKETS = re.compile(r"\[\s*(\d+)\s*/\s*\d+\s*\]\s*\[\s*(\d+)\s*/\s*(\d+)\s*\]")  # [epoch/E][n/N]


@cache
def _rank(printed: str) -> int:
    """The place in `COUNTERS` of a counter as the step regex found it (``steps`` is ``step``):
    the longest name it starts with."""
    names = [(len(c.name), -at) for at, c in enumerate(COUNTERS) if printed.startswith(c.name)]
    return -max(names)[1]


class Steps:
    """Where a line is: its step, from the counters it prints and the epoch it is in."""

    def __init__(self) -> None:
        self.epoch: int | None = None  # the last epoch printed
        self.first: int | None = None  # the first epoch's number: 0 or 1
        self.weak = False  # whether the last line's step is only its epoch
        self.counted: tuple[int | None, int, int] | None = None  # last count: epoch, n, offset
        self.run_on: int | None = None  # the offset of counts that run on across epochs
        self.within: tuple[int, int, int] | None = None  # a count with no total: epoch, n, offset
        self.onward: tuple[int, int, int] | None = None  # the first counted on: epoch, n, step
        self.counter: int | None = None
        """The last step a counter or a count gave: a line that names
        only its epoch, below it, has no step of its own (fairseq's ``| epoch 003 | valid on
        'valid' subset | valid_loss ...`` after ``| epoch 003 | loss ... | num_updates 1101``):
        it goes with the records around it, not back to step 3 (no restart)."""

    def of(self, low: str) -> tuple[int | None, tuple[int, ...]]:
        """The step of a lower-cased line (or None), and all the counters it prints."""
        epoch, self.weak = _EPOCH.search(low) if "epoch" in low else None, False
        if epoch is not None:
            self._epoch(int(epoch[1]))
        if any(map(low.__contains__, _NEEDED)):
            named = _STEP.findall(low)
            if len(named) > 1:  # "iter 8 step 1" is step 1, but not the line "iter 9 step 1"
                named.sort(key=lambda found: _rank(found[0]))
                step = self.counter = self._on(int(named[0][1]), named[0][2], epoch is not None)
                return step, (step, *(int(found[1]) for found in named[1:]))
            if named:
                step = self.counter = self._on(int(named[0][1]), named[0][2], epoch is not None)
                return step, (step,)
        found = self._count(low, epoch)
        if found is None:
            return None, ()
        if not self.weak:
            self.counter = found
        return found, (found,)

    def named(self, step: int) -> None:
        """Where a line is whose named counter gives its step and that names no epoch (one a
        learnt template reads): what `of` keeps of such a line."""
        self.weak, self.counter = False, step

    def _count(self, low: str, epoch: re.Match[str] | None) -> int | None:
        """The step of a line without a named counter: a count, else its epoch."""
        ranged = _RANGE.search(low) if "batch" in low else None
        if ranged is not None:
            return int(ranged[1])
        count = None
        if "/" in low:
            both = _BRACKETS.search(low) if epoch is None and "][" in low else None
            if both is not None:  # "Train: [29/300][2670/2859]": the epoch, the count within it
                self._epoch(int(both[1]))
                return self._counted(int(both[2]), both[3], True)
            count = epoch and _AFTER_EPOCH.match(low, epoch.end())
            count = count or _BAR.search(low) or _BRACKET.search(low)
        if count:
            return self._counted(int(count[1]), count[2], epoch is not None)
        leading = _LEADING.match(low)
        if leading is not None:
            return int(leading[1] or leading[2])
        if epoch is None:
            return None
        step = int(epoch[1])
        if self.counter is not None and step < self.counter:
            return None  # (a line's epoch alone, below the counted steps: see `counter`)
        self.weak = True
        return step

    def _epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if self.first is None:
            self.first = 0 if epoch == 0 else 1

    def _counted(self, count: int, total: str, here: bool) -> int:
        """A count ``n/N`` within the epoch it is in (`_on`), unless the counts ran on when an
        epoch printed on a line of its own (``here``: on this line) began: kohya's bar
        ``steps: 82/3280`` below ``epoch 2/80`` counts the whole run, 41 steps an epoch; from then
        on a count is the step, plus the offset of the epoch it ran on from."""
        if self.run_on is None and not here and self.counted is not None:
            epoch, last, offset = self.counted
            if self.epoch != epoch and count > last:
                self.run_on = offset
        if self.run_on is not None:
            return self.run_on + count
        step = self._on(count, total, True)
        self.counted = (self.epoch, count, step - count)
        return step

    def _on(self, count: int, total: str, in_epoch: bool) -> int:
        """A count, counted on from the epochs before this one: ``total`` of them an epoch, or,
        where no total is printed, as far as the epoch before counted (`_within`)."""
        if not (in_epoch and self.epoch is not None and self.first is not None):
            return count
        if total:
            return (self.epoch - self.first) * int(total) + count
        return self._within(count, self.epoch)

    def _within(self, count: int, epoch: int) -> int:
        """A count with no total on a line that names its epoch (``epoch: 2, iter: 100``). Where
        the epoch went up and the count started over, the count is within the epoch: it counts
        on from the last count of the epoch before (one more where it starts at 0), not a new
        run. A count that did not start over counts the run (fairseq's ``num_updates``); an
        epoch that went back, or a count that went back within one, is a new run's."""
        offset = 0
        if self.within is not None:
            before, last, offset = self.within
            if epoch > before and count <= last:
                offset += last + (count == 0)
                self.onward = self.onward or (epoch, count, offset + count)
            elif epoch < before:
                offset = 0
        self.within = (epoch, count, offset)
        return offset + count


def counter_spans(low: str) -> list[tuple[int, int]]:
    """Where `Steps.of` reads the counters a lower-cased line names (the span of each count, the
    step's first, the others in the order of its ``where``); empty where it names none. For
    `templates`: the step of a line of a learnt template is read from its span."""
    if not any(map(low.__contains__, _NEEDED)):
        return []
    return [found.span(2) for found in sorted(_STEP.finditer(low), key=lambda m: _rank(m[1]))]


def counted_by(values: dict[str, float]) -> int | None:
    """The step that a key of a line's values names, popped off them: a path whose last part is
    a counter (`_KEYED`), a count (``'counters/updates': 5024`` in a dict of train stats that
    also counts examples), else None."""
    for key, value in values.items():
        counter = "/" in key and key.rpartition("/")[2].lower() in _KEYED
        if counter and value >= 0 and value == int(value):  # (NaN and 1.5 are no count)
            del values[key]
            return int(value)
    return None
