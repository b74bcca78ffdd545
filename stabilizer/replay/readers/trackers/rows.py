"""A tracker's rows as records: what the W&B, MLflow and trackio readers share (`TrackerRows`).

A tracker keeps a run as rows: the names and values of one ``log`` call, at a step of the
tracker's own (W&B's ``_step`` and trackio's ``step`` count ``log`` calls; MLflow's is the step
the caller gave, one metric a row). They become records as any structured log's rows do:

- The step is the trainer's own counter where a row logs one (`COUNTERS`: Lightning's
  ``trainer/global_step``, the HF Trainer's ``train/global_step``, ``global_step``), else the
  tracker's. A row without the counter, in a run that logs it, is at the last step: an eval row
  (``eval/loss``) lands beside the training record it followed, never as a training loss.
- Rows of one step next to each other merge (later values win).
- A metric logged again at or below a step it was logged at before: the run restarted (resumed
  from a checkpoint), a `Restart` before the record.
- A row behind the run's step whose metrics are new there is on another clock (a metric logged
  per epoch against the epoch number): left out, counted in one note.
- Names map through `KeyMap`; the trackers' bookkeeping (`BOOKKEEPING`) and the counters are no
  metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from stabilizer.core.records import StepRecord

from .._keys import KeyMap
from ..base import Item, LogReadError, Restart

__all__ = ["BOOKKEEPING", "COUNTERS", "TrackerRows", "missing_extra", "number"]

COUNTERS = ("trainer/global_step", "train/global_step", "global_step")
"""The trainer's optimizer-step counter as trackers log it, first found wins."""

BOOKKEEPING = frozenset(("_step", "_runtime", "_timestamp", *COUNTERS))
"""Names a tracker or the counters fill in: no metric."""

_LARGEST = 2**62  # a step past this is no step


def number(value: object) -> float | None:
    """A logged value as a float: ints and floats, and the strings trackers write for the
    values JSON has no word for (``NaN``, ``Infinity``, ``-Infinity``); None for anything else
    (text, media, booleans)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value in _SPECIAL:
        return _SPECIAL[value]
    return None


_SPECIAL = {"NaN": math.nan, "nan": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def missing_extra(extra: str, what: str) -> LogReadError:
    """The one-line error of a reader whose optional dependency is not installed."""
    return LogReadError(
        f"reading {what} needs the {extra} extra: pip install 'stabilizer-lightning[{extra}]'"
    )


class TrackerRows:
    """Turns a run's rows into records (see the module docstring).

    Args:
        note: Leaves a note (kind, message): a reader's `BaseReader.note`.
        begun: Why the first record is a restart (a new run followed after another), if it is.
    """

    def __init__(self, note: Callable[[str, str], None], begun: str = "") -> None:
        self._note, self._begun = note, begun
        self._keys = KeyMap()
        self._step: int | None = None  # the step of the rows gathered last
        self._raw: dict[str, float] | None = None  # their values, until handed out
        self._last: dict[str, int] = {}  # name → the step it was last logged at (this segment)
        self._counted = False  # the run logs a counter of `COUNTERS`
        self._behind = 0  # rows left out: behind the run's step, on another clock

    def add(self, own: int | None, row: Mapping[str, float]) -> list[Item]:
        """The items that a row completes (the record before it, a restart).

        Args:
            own: The tracker's step of the row (None when it has none).
            row: The row's numeric values by logged name.
        """
        step = self._step_of(own, row)
        values = {name: value for name, value in row.items() if name not in BOOKKEEPING}
        if step is None or not values:
            return []
        if step == self._step:
            self._raw = {**(self._raw or {}), **values}
            self._seen(values, step)
            return []
        restart = any(self._last.get(name, step - 1) >= step for name in values)
        if not restart and self._step is not None and step < self._step:
            self._behind += 1
            return []
        items = self.flush()
        if restart or self._begun:
            why = self._begun or f"step went back from {self._step} to {step}"
            items.append(Restart(step, None, why))
            self._last.clear()
            self._begun = ""
        self._step, self._raw = step, dict(values)
        self._seen(values, step)
        return items

    def flush(self) -> list[Item]:
        """The record of the rows gathered last, if not handed out yet (a followed store waits:
        its last step is complete as far as anyone knows)."""
        if self._raw is None or self._step is None:
            return []
        record = StepRecord(self._step, self._keys.values(self._raw))
        self._raw = None
        return [record]

    def done(self) -> list[Item]:
        """The last record; the note on rows left out."""
        if self._behind:
            what = f"{self._behind} row(s) logged at steps behind the run's"
            self._note("skipped", f"{what} (another clock, such as epochs): left out")
            self._behind = 0
        return self.flush()

    def _step_of(self, own: int | None, row: Mapping[str, float]) -> int | None:
        for counter in COUNTERS:
            value = row.get(counter)
            if value is not None and math.isfinite(value) and abs(value) < _LARGEST:
                self._counted = True
                return int(value)
        if self._counted:
            return self._step
        return own if own is not None and abs(own) < _LARGEST else None

    def _seen(self, values: Mapping[str, float], step: int) -> None:
        for name in values:
            self._last[name] = step
