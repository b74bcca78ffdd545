"""`JsonlReader`: the monitor's own ``stability.jsonl``, and flat JSON-lines metric logs.

The monitor writes one strict-JSON object per line; non-finite floats are ``"nan"``, ``"inf"``::

    {"type":"run","precision":"16-mixed",...}              a RunHeader (first; older logs: none)
    {"type":"step","step":120,"values":{"loss":2.51,"grad_norm":0.83,"lr":"nan"}}
    {"type":"finding","kind":"loss_spike","step":118,...}

Each line is an item of the stream, where the log has it: the `RunHeader`, a `StepRecord` (keys
are signal keys already), a `Finding` (the monitor's own; `diagnose` keeps those only the live
run can know). A flat object with a ``step`` (``{"step": 10, "train/loss": 2.5}``, as many
trackers write) is a record too, its names mapped through the shared aliases. Lines that are
not JSON objects are skipped, with one note that counts them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import IO, Any, ClassVar

from stabilizer.core.records import Finding, StepRecord
from stabilizer.core.run import RunHeader

from ._keys import KeyMap
from ._lines import Segments, numbered_lines
from .base import BaseReader, Item

__all__ = ["JsonlReader"]

_DECODER = json.JSONDecoder()
_OTHER: dict[str, Callable[[dict[str, Any]], Item]] = {
    "run": RunHeader.from_dict,
    "finding": Finding.from_dict,
}
"""The monitor's lines that are no record, by ``type``: items of the stream as they are."""
_BAD = (
    ValueError, TypeError, KeyError, AttributeError, RecursionError, OverflowError
)  # fmt: skip


class JsonlReader(BaseReader):
    """Reads JSON-lines logs (see the module docstring)."""

    format: ClassVar[str] = "jsonl"

    @classmethod
    def sniff(cls, head: list[str]) -> float:
        best = 0.0
        for line in head:
            text = line.strip()
            if text.startswith(
                ('{"type":"step"', '{"type": "step"', '{"type":"finding"', '{"type":"run"')
            ):
                return 1.0
            if text.startswith("{") and '"step"' in text and _object(text) is not None:
                best = 0.7
        return best

    def _items(self, stream: IO[bytes]) -> Iterator[Item]:
        keys, segments, bad = KeyMap(), Segments(), 0
        for lineno, line in numbered_lines(stream, self.notes):
            text = line.strip()
            if not text:
                continue
            try:
                # The object counts even if text follows it: a JSON array written an entry a
                # line ends its lines with commas.
                data = _DECODER.raw_decode(text)[0]
                kind = data.get("type")
                if kind in _OTHER:
                    yield _OTHER[kind](data)
                    continue
                if kind == "end":  # how the run ended: the console's end line
                    continue
                step, values = _parse(data, keys)
            except _BAD:
                bad += 1
                continue
            restart = segments.restart(step, lineno)
            if restart is not None:
                yield restart
            yield StepRecord(step, values)
        if bad:
            self.note("skipped", f"{bad} line(s) not JSON records: skipped")


def _parse(data: Any, keys: KeyMap) -> tuple[int, dict[str, float]]:
    """The step and values of a line's JSON: a monitor's step, or a flat object with a ``step``."""
    if data.get("type") == "step":
        return _int(data["step"]), {str(k): float(v) for k, v in data["values"].items()}
    raw = {k: float(v) for k, v in data.items() if k != "step" and _number(v)}
    return _int(data["step"]), keys.values(raw)


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ValueError(f"a step must be an integer, got {value!r}")
    return int(value)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _object(text: str) -> dict[str, Any] | None:
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None
