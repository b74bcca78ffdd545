"""`Joiner`: the lines of a console log put together into records, the way they were printed.

Lines of one step make one record (later values win); a step's line and the lines right below
it that it wraps onto, or that are indented under it, are one record; a record without a step
equal to the one before it is that record printed twice; records without a step are placed just
before the next step (and after the last), or at their position in the log if none has one; a
`Restart` comes just before the first record after the step went back or a resume banner. A
message of the trainers' catalogue (`words`) is a record of what it says; the lines that print
one event (by several ranks, by two loggers) make one record, and a message that reports
trouble comes out beside its record as a finding that the trainer said it. The rules, and the
real logs behind them: docs/readers.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from stabilizer.core.records import StepRecord
from stabilizer.core.signals import LOSS, VOCAB_SIZE

from .._lines import resume_banner
from .._shapes import vocab_of
from ..aliases import BAR_LOSS, SIGNALS, VAL_LOSS
from ..base import Item, Restart
from ..words import Heard, Told, Words, printed_again
from .shapes import Series
from .values import total, values_of

__all__ = ["MAX_HELD", "Joiner"]

MAX_HELD = 1000  # records without a step kept waiting for one; more are placed at once
_TIME = re.compile(r"\d:\d\d:\d\d(?:[.,]\d+)?")  # a time of day, as loggers print it
_HEADER = re.compile(r"\d:\d\d:\d\d|\b(?:INFO|WARNING|WARN|ERROR|DEBUG)\b")  # a new log entry
_BAR_END = re.compile(r"(?:it/s|s/it)(?:,[^\]]*)?\]")  # a tqdm bar's end: "2.2it/s, loss=3]"
_ALONE = re.compile(r"\s*[A-Za-z_][\w./-]*(?: [A-Za-z_][\w./-]*)?\s*[:=]?\s*\S+\s*")  # "name: x"
_Values = dict[str, float]
_Held = tuple[_Values, "Words | None", str]  # a record's values, its message's row, its line


@dataclass(slots=True)
class _Pending:
    """The record being put together from the lines of one step."""

    step: int | None
    where: tuple[int, ...]  # every counter its first line printed (an overflow's: its rank)
    values: dict[str, float]
    text: str  # the line (joined with the lines it wraps onto)
    start: int  # its first line number
    end: int  # its last line number
    overflow: bool = False  # an fp16 scaler's overflow, or another message of the catalogue
    bar: bool = False  # its loss is a progress bar's (`Joiner.lined`)
    banner: str = ""  # the resume banner before it, if any
    words: Words | None = None  # the catalogue's row of its message, where it is one
    last: str = ""  # its last line, where it is a message


@dataclass
class Joiner:
    """Puts lines together into records, places records without a step, marks restarts."""

    pending: _Pending | None = None
    held: list[_Held] = field(default_factory=list)  # records waiting for a step
    previous: dict[str, float] | None = None  # the values of the record before
    logged: int | None = None  # the last step a line printed
    last: int | None = None  # the last step given to a record
    banner: str = ""  # a resume banner seen since the last record
    vocab: float | None = None  # the vocabulary a line stated, for the next record
    told: Told = field(default_factory=Told)  # the rows said in a finding already
    announced: int | None = None
    """A step a line named with no value (verl's ``[Global Step: 20] Update Actor Ends ...``)
    and no record has yet: a message of the catalogue after it, with no step of its own, is of
    that step (``WARN: rank 0 grad_norm is not finite: inf``), and so is every message after it
    until a record comes, not placed after the last record."""
    lined: bool = False
    """Whether a line that is no progress bar has printed a loss: from then on, a bar's loss
    (tqdm's postfix or description: one batch's loss) is `BAR_LOSS`, a series of its own shown
    beside the trainer's own records of the loss (lift3d's ``[INFO] [train] epoch=41,
    loss=0.4149`` under its bar's ``loss=0.038908``), not judged as the loss."""

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
        bar = False  # (a line that is no bar costs no call once one has printed a loss)
        if LOSS in values and (not self.lined or "it/s" in line or "s/it" in line):
            bar = self._bar(line, values)
        pend, (step, where) = self.pending, at
        if pend is not None and not pend.overflow:
            if step is None and _breakdown(pend, values):  # "mean center loss : 2638.2" under
                pend.values.update(values)  # "Mean Training loss : nan": the parts of its loss
                return []
            if step is not None and where == pend.where and not self.banner:  # later wins
                pend.values.update(values)
                pend.end = lineno
                return []
            if step is None and lineno == pend.end + 1 and _alone(pend, values, line):
                pend.values.update(values)  # "Iter: 3100", then "stage1_pafs_loss: 5.46" a line
                pend.end = lineno
                return []
            if step is None and lineno == pend.end + 1 and _wraps(pend, values, line):
                if VAL_LOSS in values:  # an evaluation's line: its values on the current step
                    pend.values.update(values)
                else:
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
        self.pending.bar, self.banner = bar, ""
        return done

    def _bar(self, line: str, values: _Values) -> bool:
        """Whether a line's loss is a progress bar's; its loss made `BAR_LOSS` where a line that
        is no bar has printed one (`lined`), and so the pending bar's when this is that line."""
        if _in_bar(line):
            if self.lined:
                values[BAR_LOSS] = values.pop(LOSS)
            return True
        pend, self.lined = self.pending, True
        if pend is not None and pend.bar and LOSS in pend.values:
            pend.values[BAR_LOSS] = pend.values.pop(LOSS)
        return False

    def overflow(self, lineno: int, line: str, values: _Values, rank: int | None) -> list[Item]:
        """An overflow line: one more line of the pending overflow (printed again, by another
        rank or logger), or a new one (the same rank reports again, at another time: at the
        floor the scale stays 1 skip after skip)."""
        pend = self.pending
        if pend is not None and pend.overflow and pend.words is None:
            last = (pend.values, pend.where[0] if pend.where else None)
            if printed_again(line, (values, rank), pend.text, last):
                pend.values.update(values)
                return []
        return self._message(lineno, line, values, rank)

    def heard(self, lineno: int, line: str, heard: Heard, values: _Values) -> list[Item]:
        """A message of the catalogue, with the signals its line printed (``values``): one more
        line of the event the pending message tells (the line right below it, another text:
        another logger's, another rank's), or a new event (the same text again)."""
        pend, values = self.pending, {**values, **heard.values}
        adjacent = pend is not None and pend.overflow and lineno == pend.end + 1
        if pend is not None and adjacent and _same_event(line, heard.rank, pend):
            pend.values.update(values)
            pend.end, pend.last = lineno, line
            if heard.words.severity and not (pend.words and pend.words.severity):
                pend.words, pend.text = heard.words, line
            return []
        done = self._message(lineno, line, values, heard.rank, heard.step)
        assert self.pending is not None
        self.pending.words, self.pending.last = heard.words, line
        return done

    def announce(self, step: int) -> None:
        """A line named ``step`` (a counter, not only its epoch) and printed no value."""
        if self.logged is None or step >= self.logged:
            self.announced = step

    def _message(
        self, lineno: int, line: str, values: _Values, rank: int | None, step: int | None = None
    ) -> list[Item]:
        done = self._finish()
        step = self.announced if step is None else step
        where = () if rank is None else (rank,)
        self.pending = _Pending(step, where, values, line, lineno, lineno, overflow=True)
        return done

    def series(self, lineno: int, line: str, found: list[Series]) -> list[Item]:
        """The records a line's shape gives (`Shapes.read`: the lines of a series so far)."""
        done: list[Item] = []
        for step, values in found:
            done += self.line(lineno, line, (step, () if step is None else (step,)), values)
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
        if pend is None or not (pend.values or pend.words):  # (a message may state no value)
            return []
        if pend.step is None:
            if pend.overflow or pend.values != self.previous:  # (a NaN is equal to nothing)
                self.held.append((pend.values, pend.words, pend.text))
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
        if pend.words is None:  # (most records: no message)
            self.announced = None  # (the messages after an announced step are all of it)
            done.append(StepRecord(pend.step, total(pend.values)))
        else:
            done += self._record(pend.step, (pend.values, pend.words, pend.text))
        return done

    def _place(self, before: int | None) -> list[Item]:
        """The held records: just before step ``before``, or (None) after the last record."""
        held, self.held = self.held, []
        after = 1 if self.last is None else self.last + 1  # (1: a position in the log)
        start = after if before is None else max(before - len(held), after if self.last else 0)
        placed: list[Item] = []
        for offset, record in enumerate(held):
            step = start + offset if before is None else min(start + offset, before)
            self.last = step
            placed += self._record(step, record)
        return placed

    def _record(self, step: int, record: _Held) -> list[Item]:
        """The record of ``step``, and after it, the first time its message's row reports
        trouble, the finding that the trainer said so."""
        values, words, text = record
        found: list[Item] = [StepRecord(step, total(values))] if values else []
        return found + self.told.tell(words, step, text)


def _breakdown(pend: _Pending, values: _Values) -> bool:
    """Whether a line without a step, of loss parts named ``<part>_loss`` and no other signal,
    breaks down the loss of the pending record (Caffe's ``Train net output #1:
    cross_entropy_loss = 9.2 (* 20 = 184.4 loss)`` under its ``Iteration 0, loss = 184.4``);
    without a loss above them they are a record of their own (ObjectGS's ``losses:
    {'image_loss': tensor(0.3150, ...)}``)."""
    return (
        LOSS in pend.values
        and any(key.endswith("_loss") for key in values)
        and not any(key in SIGNALS or key.startswith("loss_") for key in values)
        and not set(values).intersection(pend.values)
    )


def _same_event(line: str, rank: int | None, pend: _Pending) -> bool:
    """Whether a message right below the pending one tells the same event: another rank's line,
    or another text (another logger's: ``ERROR:tensorflow:Model diverged ...`` and absl's
    ``E0410 22:34:13.729731 ... Model diverged ...``) printed at the same time, or with no time.
    The same text again, or a line of another time, is a new event (ESPnet says "The grad norm
    is nan" at every step it skips)."""
    if rank is not None and pend.where and pend.where != (rank,):
        return True
    if line == pend.last:
        return False
    now, then = _TIME.search(line), _TIME.search(pend.last)
    return now is None or then is None or now[0] == then[0]


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


def _in_bar(line: str) -> bool:
    """Whether the loss of a line is its progress bar's: in tqdm's description or postfix, not
    after the bar's end (``...5.00it/s]{'loss': 2.16}``: the HF Trainer's record printed after a
    bar, with no newline between; ``...1.66s/it]Beginning of Epoch 2/18``: a bar's loss)."""
    if "it/s" not in line and "s/it" not in line:  # (most record lines: no bar, two scans in C)
        return False
    ends = [found.end() for found in _BAR_END.finditer(line)]
    return bool(ends) and LOSS not in values_of(line[ends[-1] :])


def _alone(pend: _Pending, values: _Values, line: str) -> bool:
    """Whether a line that is one value alone (``name: value``), right below a record's lines,
    is one more value of that record, unless it names one the record has: a block of values
    under a counter's line (pose estimation's ``Iter: 3100``, then ``stage1_pafs_loss: 5.46``
    and three more parts a line), or the block without it where a log begins."""
    return (
        len(values) == 1
        and values.keys().isdisjoint(pend.values)
        and _ALONE.fullmatch(line) is not None
    )


def _wraps(pend: _Pending, values: _Values, line: str) -> bool:
    """Whether a line without a step continues the pending record's line (see the module doc):
    a line that is no new log entry, or an entry of the same moment as the record's (Sockeye
    logs ``Checkpoint [88] Updates=440000 ...`` and ``Checkpoint [88] Train-perplexity=2.6``
    as two entries of one second), with signals the record lacks."""
    known = {key for key in values if key in SIGNALS or key.startswith("loss_")}
    return (
        bool(known)
        and not (pend.bar and LOSS in values)  # (a bar's loss, then the trainer's: 2 series)
        and not known.intersection(pend.values)
        and (not _HEADER.search(line) or _same_moment(line, pend.text))
    )


def _same_moment(line: str, text: str) -> bool:
    """Whether two log entries print the same time of day (to the second, or finer)."""
    now, then = _TIME.search(line), _TIME.search(text)
    return now is not None and then is not None and now[0] == then[0]
