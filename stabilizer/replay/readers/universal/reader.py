"""`UniversalReader`: any console log, read the way a person reads it.

A record is a line with metrics beside a step::

    iter 100: loss 2.3456, time 12.34ms            step:10/1000 train_loss:7.5
    [2018-11-26 15:06:01,481 INFO] Step 5650/50000; acc: 0.19; xent: nan; lr: 0.00070
    | epoch 027 | loss 6.343 | gnorm 0.390 | loss_scale 0.500 |      s:12 trl:9.79 norm:3.01
    Epoch 0:  6%|▌   | 1/18 [00:08<02:29, loss=10.473]    {'loss': 0.58, 'grad_norm': 1.3}

Each line goes once through the loop of `UniversalReader.read_lines`: its step (`steps`), its
metrics (`values`), an overflow or a table (`_shapes`, `tables`); the `Joiner` below puts the
lines of one step together into one record, places records without a step and marks restarts.
What is no record (tracebacks, banners, timestamps) is skipped. The rules, and the real logs
behind each, are in docs/readers.md.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, ClassVar

from stabilizer.core.records import StepRecord
from stabilizer.core.signals import VOCAB_SIZE

from .._lines import ANSI, IDLE, resume_banner, text_lines
from .._shapes import OVERFLOW_NEEDS, overflow_in, printed_again, vocab_of
from ..aliases import SIGNALS
from ..base import BaseReader, Item, Restart
from .steps import Steps
from .tables import numbered_blocks, row_of, table_of
from .values import known, total, values_of

__all__ = ["MAX_HELD", "UniversalReader", "unreadable_message"]

MAX_HELD = 1000  # records without a step kept waiting for one; more are placed at once
_HEADER = re.compile(r"\d:\d\d:\d\d|\b(?:INFO|WARNING|WARN|ERROR|DEBUG)\b")  # a new log entry
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
        steps, join = Steps(), Joiner()
        table: tuple[str, ...] | None = None  # the columns of the table being read
        above = ""  # the last line that was no record (a table's header, if a ruler follows)
        for lineno, line in numbered_blocks(lines):
            if line is IDLE:  # a followed log waits: the pending record is done
                yield from join.done()
                continue
            if "\x1b" in line:
                line = ANSI.sub("", line)
            if table is not None:
                row = row_of(line, table)
                table, line = (None, line) if row is None else (table, row)
            low = line.lower()
            if any(map(low.__contains__, OVERFLOW_NEEDS)) and (found := overflow_in(low)):
                yield from join.overflow(lineno, line, *found)
                continue
            step, where = steps.of(low)
            values = values_of(line)
            if (step is None or steps.weak) and not known(values):
                if step is None:
                    if values and join.wraps(lineno, line, values):  # "learning rate: ... |"
                        yield from join.line(lineno, line, (None, ()), values)
                        continue
                    table, above = table_of(line, low, above), line
                    join.other(line)
                    continue
                if steps.weak:  # "begin training epoch 1": no record, but one may follow
                    values = {}
            yield from join.line(lineno, line, (step, where), values)
        yield from join.end()


@dataclass(slots=True)
class _Pending:
    """The record being put together from the lines of one step."""

    step: int | None
    where: tuple[int, ...]  # every counter its first line printed (an overflow's: its rank)
    values: dict[str, float]
    text: str  # the line (joined with the lines it wraps onto)
    start: int  # its first line number
    end: int  # its last line number
    overflow: bool = False
    banner: str = ""  # the resume banner before it, if any


@dataclass
class Joiner:
    """Puts lines together into records, places records without a step, marks restarts."""

    pending: _Pending | None = None
    held: list[dict[str, float]] = field(default_factory=list)  # records waiting for a step
    previous: dict[str, float] | None = None  # the values of the record before
    logged: int | None = None  # the last step a line printed
    last: int | None = None  # the last step given to a record
    banner: str = ""  # a resume banner seen since the last record
    vocab: float | None = None  # the vocabulary a line stated, for the next record

    def other(self, line: str) -> None:
        """A line that is no record: after a record, it may be a resume banner; it may state
        the vocabulary (litgpt's and nanoGPT's configuration: chance level is ln of it)."""
        if (self.logged is not None or self.pending is not None) and not self.banner:
            self.banner = resume_banner(line)
        self.vocab = vocab_of(line) or self.vocab

    def line(
        self, lineno: int, line: str, at: tuple[int | None, tuple[int, ...]], values: _Values
    ) -> list[Item]:
        """A line with a step or a metric: it joins the pending record or starts the next one.

        Returns the items it completes (lists, not generators: a line is read in microseconds,
        and a generator per line costs a good part of that).
        """
        pend, (step, where) = self.pending, at
        if pend is not None and not pend.overflow:
            if step is not None and where == pend.where and not self.banner:  # later wins
                pend.values.update(values)
                pend.end = lineno
                return []
            if step is None and lineno == pend.end + 1 and _wraps(pend, values, line):
                pend.text += line  # re-read joined: "| learning" + " rate: 4.475E-05 |"
                pend.values = {**pend.values, **values_of(pend.text)}
                pend.end = lineno
                return []
            if step is None and lineno == pend.end + 1 and _indented(pend, line):
                pend.values.update(values)  # "    train/CrossEntropyLoss=11.25" under its step
                pend.end = lineno
                return []
        done = self._finish()
        if self.vocab is not None:
            values[VOCAB_SIZE], self.vocab = self.vocab, None
        self.pending = _Pending(step, where, values, line, lineno, lineno, banner=self.banner)
        self.banner = ""
        return done

    def overflow(self, lineno: int, line: str, values: _Values, rank: int | None) -> list[Item]:
        """An overflow line: one more line of the pending overflow (printed again, by another
        rank or logger), or a new one (the same rank reports again, at another time: at the
        floor the scale stays 1 skip after skip)."""
        pend = self.pending
        if pend is not None and pend.overflow:
            last = (pend.values, pend.where[0] if pend.where else None)
            if printed_again(line, (values, rank), pend.text, last):
                pend.values.update(values)
                return []
        done = self._finish()
        where = () if rank is None else (rank,)
        self.pending = _Pending(None, where, values, line, lineno, lineno, overflow=True)
        return done

    def wraps(self, lineno: int, line: str, values: _Values) -> bool:
        """Whether a line without a step, that alone would be no record, continues the pending
        record's line (see `_wraps`)."""
        pend = self.pending
        return (
            pend is not None
            and not pend.overflow
            and lineno == pend.end + 1
            and (_indented(pend, line) or _wraps(pend, values, line))
        )

    def done(self) -> list[Item]:
        """The pending record, now: no more lines for it for a while (see `IDLE`)."""
        return self._finish()

    def end(self) -> list[Item]:
        """The records still held when the lines end."""
        return self._finish() + self._place(None)

    def _finish(self) -> list[Item]:
        pend, self.pending = self.pending, None
        if pend is None or not pend.values:
            return []
        if pend.step is None:
            if pend.overflow or pend.values != self.previous:  # (a NaN is equal to nothing)
                self.held.append(pend.values)
                self.previous = pend.values
            return self._place(None) if len(self.held) >= MAX_HELD else []
        back = self.logged is not None and pend.step < self.logged
        banner = pend.banner if self.last is not None or self.held else ""  # none before
        done: list[Item] = self._place(None if back or banner else pend.step) if self.held else []
        if banner:
            done.append(Restart(pend.step, pend.start, f"resume banner {pend.banner!r}"))
        elif back:
            why = f"step went back from {self.logged} to {pend.step}"
            done.append(Restart(pend.step, pend.start, why))
        self.logged = self.last = pend.step
        self.previous = pend.values
        done.append(StepRecord(pend.step, total(pend.values)))
        return done

    def _place(self, before: int | None) -> list[Item]:
        """The held records: just before step ``before``, or (None) after the last record."""
        held, self.held = self.held, []
        after = 1 if self.last is None else self.last + 1  # (1: a position in the log)
        start = after if before is None else max(before - len(held), after if self.last else 0)
        placed: list[Item] = []
        for offset, values in enumerate(held):
            step = start + offset if before is None else min(start + offset, before)
            self.last = step
            placed.append(StepRecord(step, total(values)))
        return placed


def _indented(pend: _Pending, line: str) -> bool:
    """Whether an indented line without a step, right below a record's lines, is one more line
    of that record: OLMo prints ``[step=120/20000,epoch=0]`` and then a ``name=value`` a line.
    Not under a progress bar: YOLO's indented ``all  1049  0.455 ...`` are validation results."""
    return (
        line[:1] in " \t"
        and pend.step is not None
        and "%|" not in pend.text
        and not _HEADER.search(line)
    )


def _wraps(pend: _Pending, values: _Values, line: str) -> bool:
    """Whether a line without a step continues the pending record's line (see the module doc)."""
    known = {key for key in values if key in SIGNALS or key.startswith("loss_")}
    return bool(known) and not known.intersection(pend.values) and not _HEADER.search(line)


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
