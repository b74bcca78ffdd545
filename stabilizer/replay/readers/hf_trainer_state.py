"""`HfTrainerStateReader`: the ``log_history`` of a Hugging Face ``trainer_state.json``.

The file is one JSON object (``json.dumps(..., indent=2, sort_keys=True)``, so ``log_history``
comes early). It is not loaded whole: the text is scanned up to ``"log_history": [`` and each
entry is decoded on its own with ``json.JSONDecoder.raw_decode`` as soon as it is complete
(memory: one entry, at most `MAX_ENTRY` characters). Entries are dicts with a ``step``; keys map
through the shared aliases (``loss``, ``grad_norm``, ``learning_rate``), others pass through. The
final summary entry (``train_runtime``; its ``train_loss`` is the run's mean) is skipped. Entries
of the same step next to each other (train, then eval) merge into one record. NaN is written as
``NaN`` and read as such; hidden NaN losses are noted as for the console (see `HiddenNan`).
The fp16 scaler's start-up probing (``grad_norm: NaN`` at the first steps, the loss finite) is
read as skipped steps (`Probing`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import IO, Any, ClassVar

from stabilizer.core.records import StepRecord

from ._keys import KeyMap
from ._lines import Segments, text_lines
from ._probing import Probing
from .base import BaseReader, Item
from .hf_trainer import HiddenNan

__all__ = ["MAX_ENTRY", "HfTrainerStateReader"]

MAX_ENTRY = 1 << 20  # characters of one log_history entry
_KEY = '"log_history"'


class HfTrainerStateReader(BaseReader):
    """Reads ``trainer_state.json`` (see the module docstring)."""

    format: ClassVar[str] = "hf_trainer_state"

    @classmethod
    def sniff(cls, head: list[str]) -> float:
        if any(_KEY in line for line in head):
            return 0.95
        text = "".join(head[:5]).lstrip()
        return 0.5 if text.startswith("{") and '"best_metric"' in "".join(head) else 0.0

    def _items(self, stream: IO[bytes]) -> Iterator[Item]:
        keys, hidden, segments, probing = KeyMap(), HiddenNan(self), Segments(), Probing(self)
        step, raw = None, {}  # type: int | None, dict[str, float]
        for entry in self._entries(stream):
            new = entry.pop("step", None)
            if not isinstance(new, int) or "train_runtime" in entry:
                continue
            numbers = {k: float(v) for k, v in entry.items() if _number(v)}
            if new == step:
                raw.update(numbers)
                continue
            if step is not None:
                yield from _checked(probing.take(_record(step, keys.values(raw), hidden)), hidden)
            restart = segments.restart(new, None)
            if restart is not None:
                yield from _checked(probing.flush(), hidden)
                yield restart
            step, raw = new, numbers
        if step is not None:
            yield from _checked(probing.take(_record(step, keys.values(raw), hidden)), hidden)
        yield from _checked(probing.flush(), hidden)

    def _entries(self, stream: IO[bytes]) -> Iterator[dict[str, Any]]:
        """The dicts of ``log_history``, one at a time, as soon as each is complete."""
        buf, depth, inside = "", 0, False  # unread text; its { minus its }; past the "["
        for line in text_lines(stream, self.notes):
            buf += line + "\n"
            if not inside:
                at = buf.find(_KEY)
                start = buf.find("[", at) if at >= 0 else -1
                if start < 0:
                    buf = buf[-len(_KEY) :]
                    continue
                buf, inside = buf[start + 1 :], True
                depth = buf.count("{") - buf.count("}")
            else:
                depth += line.count("{") - line.count("}")
            if depth <= 0:  # every entry begun is complete
                entries, buf, done = self._decode(buf)
                yield from entries
                if done:
                    return
                depth = buf.count("{") - buf.count("}")
            elif len(buf) > MAX_ENTRY:
                self.note("skipped", f"a log_history entry is over {MAX_ENTRY} characters")
                return

    def _decode(self, buf: str) -> tuple[list[dict[str, Any]], str, bool]:
        """``(entries, the rest, whether the list ended)`` of a buffer inside the list."""
        decode, entries = json.JSONDecoder().raw_decode, []  # type: Any, list[dict[str, Any]]
        while True:
            buf = buf.lstrip(" \t\r\n,")
            if not buf.startswith("{"):
                if buf and not buf.startswith("]"):
                    self.note("skipped", "log_history holds something that is not a dict: stopped")
                return entries, buf, bool(buf)
            try:
                entry, end = decode(buf)
            except ValueError:
                if buf.count("{") - buf.count("}") <= 0:
                    self.note("skipped", "a log_history entry is not valid JSON: stopped")
                    return entries, "", True
                return entries, buf, False
            entries.append(entry)
            buf = buf[end:]


def _record(step: int, values: dict[str, float], hidden: HiddenNan) -> StepRecord:
    """The record of a step's entries, a window of NaN losses logged as 0 read as NaN."""
    return StepRecord(step, hidden.unhide(values, None))


def _checked(records: list[StepRecord], hidden: HiddenNan) -> list[StepRecord]:
    """``records``, each looked at for hidden NaN losses on its way out."""
    for record in records:
        hidden.check(record.step, record.values, None)
    return records


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
