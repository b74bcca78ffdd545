"""`JsonlReader`: the monitor's own ``stability.jsonl``, and flat JSON-lines metric logs.

The monitor writes one strict-JSON object per line (see `StepRecord.to_json`,
`Finding.to_json`); non-finite floats are the strings ``"nan"``, ``"inf"`` and ``"-inf"``::

    {"type":"step","step":120,"values":{"loss":2.51,"grad_norm":0.83,"lr":"nan"}}
    {"type":"finding","kind":"loss_spike","step":118,...}

A run line (``{"type":"run",...}``, `RunHeader`: precision, devices, policy, ...) comes first in
the monitor's log and is yielded as an item of the stream; logs written before it existed have
none. Step lines become records as written (keys are signal keys already). Finding lines are
collected in `JsonlReader.findings` (the first `MAX_FINDINGS`), not replayed. A flat object with
a ``step`` (``{"step": 10, "train/loss": 2.5}``, as many trackers write) is read too, its names
mapped through the shared aliases. Lines that are not JSON objects are skipped, with one note
that counts them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import IO, Any, ClassVar

from stabilizer.core.records import Finding, StepRecord
from stabilizer.core.run import RunHeader

from ._keys import KeyMap
from ._lines import Segments, numbered, text_lines
from .base import BaseReader, Item, Note

__all__ = ["MAX_FINDINGS", "JsonlReader"]

MAX_FINDINGS = 10_000
_DECODER = json.JSONDecoder()
_BAD = (
    ValueError, TypeError, KeyError, AttributeError, RecursionError, OverflowError
)  # fmt: skip


class JsonlReader(BaseReader):
    """Reads JSON-lines logs (see the module docstring).

    Args:
        notes: A list to append notes to.
    """

    format: ClassVar[str] = "jsonl"

    def __init__(self, notes: list[Note] | None = None) -> None:
        super().__init__(notes)
        self.findings: list[Finding] = []

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
        for lineno, line in numbered(text_lines(stream, self.notes)):
            text = line.strip()
            if not text:
                continue
            try:
                # The object counts even if text follows it: a JSON array written an entry a
                # line ends its lines with commas.
                data = _DECODER.raw_decode(text)[0]
                if data.get("type") == "run":
                    yield RunHeader.from_dict(data)
                    continue
                if data.get("type") == "end":  # how the run ended: the console's end line
                    continue
                step, values = self._parse(data, keys)
            except _BAD:
                bad += 1
                continue
            if step is None:
                continue
            restart = segments.restart(step, lineno)
            if restart is not None:
                yield restart
            yield StepRecord(step, values)
        if bad:
            self.note("skipped", f"{bad} line(s) not JSON records: skipped")

    def _parse(self, data: Any, keys: KeyMap) -> tuple[int | None, dict[str, float]]:
        """The step and values of a line's JSON: a monitor's step, a finding (kept, no record),
        or a flat object with a ``step``."""
        kind = data.get("type")
        if kind == "step":
            values = {str(k): float(v) for k, v in data["values"].items()}
            return _int(data["step"]), values
        if kind == "finding":
            if len(self.findings) < MAX_FINDINGS:
                self.findings.append(Finding.from_dict(data))
            return None, {}
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
