"""`HfTrainerReader`: the log dicts the Hugging Face ``Trainer`` prints to the console.

A line (Python dict syntax, often glued to a tqdm bar)::

    {'loss': 2.5, 'grad_norm': 0.9, 'learning_rate': 0.0001, 'epoch': 0.5}

The dict is parsed by a regex over ``'key': number`` pairs, never evaluated. The dicts carry no
step: a record takes the count of the training bar printed since the record before (``4711/12000
[``), else counts on; a dict's own ``step`` wins (ms-swift's ``'global_step/max_steps': '105/250'``
too), and so does a step printed before it (text-generation-webui's ``Step: 3 {'loss': ...}``);
eval dicts land on the current step; the final summary is skipped. The Trainer hides NaN losses by
default (``logging_nan_inf_filter``): `HiddenNan` notes the traces, and reads a window of NaN
steps, which it logs as a loss of exactly 0, as the NaN it was. Overflow lines of DeepSpeed or apex
among the dicts are skipped steps (`words`), and a message of the trainers' catalogue that reports
trouble is said in a finding; so is the fp16 scaler's start-up probing the dicts show as
``'grad_norm': nan`` at the first steps (`Probing`). The rules in full: docs/readers.md.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from typing import IO, ClassVar

from stabilizer.core.records import StepRecord
from stabilizer.core.signals import GRAD_NORM, LOSS

from ._keys import KeyMap
from ._lines import Segments, numbered_lines
from ._probing import Probing
from .base import BaseReader, Item
from .words import Overflow, Told, overflow_of, printed_again

__all__ = ["HfTrainerReader", "HiddenNan"]

_DICT = re.compile(r"\{'\w+': ")
_PAIR = re.compile(r"'(\w+)': ([^,}]+)")
_WRAPPED = re.compile(r"'(\w+)': [\w.]+\(([^,)]+)")  # tensor(0.9, device=...), np.float32(0.9)
_STRONG = re.compile(r"\{'(?:loss|grad_norm|learning_rate|eval_loss|train_runtime)': ")
_BAR = re.compile(r"(?<![\w./:-])(\d+)/(\d+) \[")  # tqdm: " 14%|█▍  | 378/2724 [13:58<86:18"
_BEFORE = re.compile(r"\bstep\s*[:=]?\s*(\d+)[\s\]|:,-]*$", re.IGNORECASE)  # "Step:  3 {'loss'"
_COUNTED = re.compile(r"'(?:global_)?step/(?:max|total)_\w+': '(\d+)/\d+'")  # ms-swift's dicts
_WEAK = re.compile(r"\*{5} Running training \*{5}|Num examples =|transformers", re.IGNORECASE)


class HiddenNan:
    """Notes the traces of NaN losses hidden by ``logging_nan_inf_filter`` (once per kind).

    Args:
        reader: The reader whose notes get the findings.
    """

    def __init__(self, reader: BaseReader) -> None:
        self.reader = reader
        self._seen: set[str] = set()
        self._last, self._repeats = math.nan, 0  # the last loss; how often it came again
        self._positive = False  # a positive loss has been seen
        self._before = 0.0  # the loss of the training record before (`unhide`)

    def unhide(self, values: dict[str, float], line: int | None) -> dict[str, float]:
        """``values`` with a hidden NaN loss read as NaN: a loss of exactly 0 right after one of
        0.01 or more, with no finite gradient norm beside it, is a window whose every step was
        NaN or Inf (the filter adds nothing for them, and the window's sum stays 0; the Trainer
        rounds a loss to 4 decimals, so a real one falls to 0.0 from below 0.0001, and a real
        0.0 (GRPO's) has its finite gradient norm)."""
        loss, norm = values.get(LOSS), values.get(GRAD_NORM)
        if loss is None:
            return values
        before, self._before = self._before, loss
        if loss == 0.0 and before >= 0.01 and (norm is None or not math.isfinite(norm)):
            values[LOSS], self._before = math.nan, before  # (the next window of 0: NaN too)
            what = f"the loss fell from {before} to exactly 0, read as NaN (a window of NaN steps)"
            self._say("window", what, line)
        return values

    def check(self, step: int, values: Mapping[str, float], line: int | None) -> None:
        """Look at one record's ``loss`` and ``grad_norm``."""
        loss, norm = values.get(LOSS), values.get(GRAD_NORM)
        if loss is None or not math.isfinite(loss):
            return
        if norm is not None and not math.isfinite(norm):
            self._say("grad", f"grad_norm is {norm} at step {step} while the loss is finite", line)
        if loss == self._last:
            self._repeats += 1
            if self._repeats == 2 and loss != 0.0:
                what = f"the loss is exactly {loss} three times up to step {step}"
                self._say("repeat", what, line)
        else:
            self._last, self._repeats = loss, 0
        if loss == 0.0 and self._positive:
            self._say("zero", f"the loss is exactly 0 at step {step} after positive losses", line)
        self._positive = self._positive or loss > 0

    def _say(self, kind: str, what: str, line: int | None) -> None:
        if kind not in self._seen:
            self._seen.add(kind)
            why = "the HF Trainer hides NaN losses by default (logging_nan_inf_filter=True)"
            self.reader.note("hidden_nan", f"{what}: {why}; the loss curve may hide NaN", line)


class HfTrainerReader(BaseReader):
    """Reads the console output of a Hugging Face ``Trainer`` run (see the module docstring)."""

    format: ClassVar[str] = "hf_trainer"
    prefixed: ClassVar[bool] = True  # its lines are found with `search`

    @classmethod
    def sniff(cls, head: list[str]) -> float:
        if any(_STRONG.search(line) for line in head):
            return 0.9
        return 0.5 if any(_WEAK.search(line) for line in head) else 0.0

    def _items(self, stream: IO[bytes]) -> Iterator[Item]:
        keys, hidden, segments, steps = KeyMap(), HiddenNan(self), Segments(), _BarSteps()
        probing, told = Probing(self), Told()
        overflow: tuple[str, Overflow] | None = None  # the last since a dict, and its line
        for lineno, line in numbered_lines(stream, self.notes):
            if " [" in line and "/" in line:
                steps.bar(line)
            parsed = _dict(line, keys)
            if parsed is None:
                found = overflow_of(line)
                if found is None:
                    segments.other(line)
                    yield from told.said(line, steps.last)
                    continue
                if overflow is not None and printed_again(line, found, *overflow):
                    continue
                overflow, parsed = (line, found), (found[0], True, None)
            else:
                overflow = None
            if not parsed:
                continue
            values, counted, logged = parsed
            if counted:  # (an eval dict has no training loss)
                values = hidden.unhide(values, lineno)
            step = steps.of(counted, logged)
            if steps.counting and step == 1:
                self.note("format", "HF console dicts carry no step: records count log lines")
            restart = segments.restart(step, lineno)
            if restart is not None:
                yield from _checked(probing.flush(), hidden)
                yield restart
            yield from _checked(probing.take(StepRecord(step, values)), hidden, lineno)
        yield from _checked(probing.flush(), hidden)


def _checked(
    records: list[StepRecord], hidden: HiddenNan, line: int | None = None
) -> list[StepRecord]:
    """``records``, each looked at for hidden NaN losses on its way out."""
    for record in records:
        hidden.check(record.step, record.values, line)
    return records


class _BarSteps:
    """The step of each record: the training bar's count, else counting on (module docstring)."""

    def __init__(self) -> None:
        self.last = 0  # the step of the record before
        self.total: int | None = None  # the training bar's total
        self.shown: int | None = None  # the bar's count printed since the record before
        self.counting = True  # whether no bar has numbered a record yet

    def bar(self, line: str) -> None:
        """Take the count of the training bar a line shows, if any."""
        for count, total in _BAR.findall(line):
            if self.total is None:
                self.total = int(total)
            if int(total) == self.total:
                self.shown = int(count)

    def of(self, counted: bool, logged: int | None) -> int:
        """The step of the next record (``counted``: a training record, not an eval dict)."""
        if logged is not None:
            step = logged
        elif self.shown is not None:
            step, self.counting = self.shown, False
        else:
            step = self.last + counted
        self.last, self.shown = step, None
        return step


def _dict(line: str, keys: KeyMap) -> tuple[dict[str, float], bool, int | None] | tuple[()] | None:
    """What a line's dict means: its values, whether it counts as a training record (eval dicts
    do not) and its logged step (popped off the values), if any. None for a line with no dict
    (maybe a resume banner), ``()`` for a dict to skip: the final summary (its ``train_loss`` is
    the run's mean), a dict without numbers, or one whose step is no integer."""
    start = line.find("{'")
    if start < 0 or _DICT.match(line, start) is None:
        return None
    pairs = _PAIR.findall(line, start)
    if "(" in line:
        pairs += _WRAPPED.findall(line, start)
    if not pairs or "'train_runtime'" in line:
        return ()
    values = keys.rename(pairs)
    logged = values.pop("step") if "'step'" in line and "step" in values else None
    if logged is None and "step/" in line and (counted := _COUNTED.search(line, start)):
        logged = float(counted[1])
    if logged is None and start and (before := _BEFORE.search(line[:start])):
        logged = float(before[1])  # a step printed before the dict (text-generation-webui's)
    if logged is not None and not (math.isfinite(logged) and logged == int(logged)):
        return ()
    return values, "'eval_" not in line, None if logged is None else int(logged)
