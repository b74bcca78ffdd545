"""`UniversalReader`: any console log, read the way a person reads it.

A record is a line with metrics beside a step::

    iter 100: loss 2.3456, time 12.34ms            step:10/1000 train_loss:7.5
    [2018-11-26 15:06:01,481 INFO] Step 5650/50000; acc: 0.19; xent: nan; lr: 0.00070
    | epoch 027 | loss 6.343 | gnorm 0.390 | loss_scale 0.500 |      s:12 trl:9.79 norm:3.01
    Epoch 0:  6%|▌   | 1/18 [00:08<02:29, loss=10.473]    {'loss': 0.58, 'grad_norm': 1.3}

Each line goes once through the loop of `UniversalReader.read_lines`. A record line whose
template the reader has learnt is read by one match (`templates`); any other line takes the full
path (`_Reading.line`): its step (`steps`), its metrics (`values`), a message of the trainers'
catalogue (`words`: an fp16 overflow, a NaN the trainer stopped on), a table (`tables`), or
numbers no name says, read by the shape their lines repeat (`shapes`); the `Joiner` puts the
lines of one step together into one record, places records without a step and marks restarts.
What is no record (tracebacks, banners, timestamps) is skipped. The rules, and the real logs
behind each, are in docs/readers.md.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import IO, ClassVar

from stabilizer.core.records import StepRecord
from stabilizer.core.signals import GRAD_NORM, LOSS

from .._lines import ANSI, IDLE, text_lines
from ..aliases import VAL_LOSS
from ..base import BaseReader, Item
from ..words import EARLY_NEEDS, Heard, heard_early, heard_in
from .joiner import MAX_HELD, Joiner
from .shapes import SPLITS, Shapes
from .steps import Steps, counted_by
from .tables import numbered_blocks, objects, row_of, table_of
from .templates import Templates
from .values import COUNT_THEN_LOSS, EVALUATING, held_out, known, named_after, values_of

__all__ = ["MAX_HELD", "UniversalReader", "unreadable_message"]

_Values = dict[str, float]

_HINT = re.compile(  # a step or metric word with a number right after it ("step 100", "loss: 2")
    r"(?<![a-z])(?:loss|norm|lr|step|iter|epoch|batch)[a-z_]*['\"]?\s*[:=]?\s*[-+]?\.?\d"
)


class UniversalReader(BaseReader):
    """Reads any console log of steps and metrics (see the module docstring)."""

    format: ClassVar[str] = "generic"

    @classmethod
    def sniff(cls, head: list[str]) -> float:
        """Below the confident scores of dedicated readers (~0.9): this reader is the fallback."""
        found = sum(isinstance(item, StepRecord) for item in cls().read_lines(head))
        if found:
            return 0.6 if found >= 2 else 0.4
        return 0.15 if any(_HINT.search(line.lower()) for line in head) else 0.0

    def _items(self, stream: IO[bytes]) -> Iterator[Item]:
        return self.read_lines(text_lines(stream, self.notes))

    def read_lines(self, lines: Iterable[str]) -> Iterator[Item]:
        """The records of decoded lines (``\\r`` already split, as `text_lines` gives them)."""
        reading = _Reading()
        steps, join, templates = reading.steps, reading.join, reading.templates
        for lineno, line in numbered_blocks(objects(lines)):
            if line is IDLE:  # a followed log waits: the pending record is done
                yield from join.done()
            elif reading.table is None and (read := templates.read(line)) is not None:
                steps.named(read[0])  # (most lines: a record line of a learnt template)
                yield from join.line(lineno, line, read[:2], read[2])
            else:
                yield from reading.line(lineno, line)
        yield from join.end()
        if steps.onward is not None:
            epoch, count, step = steps.onward
            self.note(
                "format",
                f"the count starts over each epoch: steps count on across epochs (epoch {epoch}'s "
                f"{count} is step {step})",
            )


class _Reading:
    """The state of one reading of lines, and the full path of a line through it."""

    def __init__(self) -> None:
        self.steps, self.join, self.shapes = Steps(), Joiner(), Shapes()
        self.templates = Templates()
        self.table: tuple[str, ...] | None = None  # the columns of the table being read
        self.above = ""  # the last line that was no record (a table's header, if a ruler follows)

    def line(self, lineno: int, line: str) -> list[Item]:
        """The items a line completes, read by its words: its step, its metrics, a message of the
        catalogue, a table's row, a shape of numbers."""
        steps, join = self.steps, self.join
        if self.table is not None or "\x1b" in line:
            line, self.table = _row(line, self.table)
        low = line.lower()
        if any(map(low.__contains__, EARLY_NEEDS)) and (heard := heard_early(low)):
            return self._overflow(lineno, line, low, heard)
        step, where, values = _where(steps, line, low)
        if step is not None and not steps.weak and (LOSS in values or GRAD_NORM in values):
            if self.table is None:
                self.templates.learn(line, low, (step, where, values))
            return join.line(lineno, line, (step, where), values)
        signals = known(values)
        if (step is None or not signals) and (heard := heard_in(low)) is not None:
            return join.heard(lineno, line, heard, {k: values[k] for k in signals})
        if step is not None or signals:  # "begin training epoch 1": a weak step, no record
            kept = values if signals or not steps.weak else {}  # (but one may follow)
            if step is not None and not signals and not steps.weak:
                join.announce(step)
            return join.line(lineno, line, (step, where), kept)
        if values and join.wraps(lineno, line, values):  # "learning rate: ... |"
            return join.line(lineno, line, (None, ()), values)
        bare = not values or all(map(SPLITS.__contains__, values))  # (values_of: {"train": 7.33})
        if bare and (found := self.shapes.read(line)):  # "76930 2.6496577", "76 train 7.33"
            return join.series(lineno, line, found)
        self.table, self.above = table_of(line, low, self.above), line
        join.other(line)
        return []

    def _overflow(self, lineno: int, line: str, low: str, heard: Heard) -> list[Item]:
        """An fp16 scaler's overflow line, at the count of the bar it is glued to, if any
        (``378/2724 [13:58<86:18, 132.44s/it][...] [deepspeed] OVERFLOW!``)."""
        step, _ = self.steps.of(low)
        if step is not None and not self.steps.weak:
            self.join.announce(step)
        return self.join.overflow(lineno, line, heard.values, heard.rank)


def _where(steps: Steps, line: str, low: str) -> tuple[int | None, tuple[int, ...], _Values]:
    """A line's step, every counter it prints, and its metrics (`values_of`): the step a key of
    them names (``'counters/updates': 5024``); none for an evaluation's line (a word before
    its loss says so, `EVALUATING`: its values are held out, `held_out`)."""
    step, where = steps.of(low)
    values = values_of(line) or (named_after(line) if "," in line else {})
    if step is None and "/" in line and (counted := counted_by(values)) is not None:
        step, where = counted, (counted,)
    said = step is None and (LOSS in values or VAL_LOSS in values)
    if said and (before := COUNT_THEN_LOSS.search(low)) is not None:  # "Train loss 130950 0.41"
        step, where = int(before[1]), (int(before[1]),)
    if LOSS in values and (at := low.find("loss")) > 2 and EVALUATING.search(low, 0, at):
        held_out(values)  # an evaluation's line: its batch counts no training step
        step, where = None, ()
    return step, where, values


def _row(line: str, table: tuple[str, ...] | None) -> tuple[str, tuple[str, ...] | None]:
    """A line without its ANSI codes, as a row of the table being read (written out as
    ``name=value``), and that table's columns (None: the table ended, or none is read)."""
    if "\x1b" in line:
        line = ANSI.sub("", line)
    if table is not None:
        row = row_of(line, table)
        return (line, None) if row is None else (row, table)
    return line, table


def unreadable_message(name: str, lines: Iterable[str], format: str = "generic") -> str:
    """The one-line error for a log in which no record was found.

    Says what was looked for (for ``generic``, this reader's steps and metrics), shows the first
    line that looked like a record (a step or metric word and a number), and names ``--format``.

    Args:
        name: The log's name, as messages show it.
        lines: The log's first lines (decoded).
        format: The format it was read as.
    """
    if format == UniversalReader.format:
        message = f"{name}: no training steps found; looked for {_LOOKED_FOR}"
        advice = "if the log has a format of its own, name it with --format"
    else:
        message = f"{name}: no training steps found in this {format} log"
        advice = "if it is another format, name that with --format (or auto)"
    for lineno, line in enumerate(lines, 1):
        if _HINT.search(line.lower()):
            message += f"; line {lineno} looked like one but was not read: {line.strip()[:100]!r}"
            break
    return f"{message}; {advice}"


_LOOKED_FOR = (
    "lines with a step (step, iter, iteration, global_step, num_updates, update, batch, "
    "Epoch n/N, [n/N]) and metrics beside it (loss, grad_norm, lr, loss_scale or an alias)"
)
