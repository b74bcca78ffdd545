"""`JsonlReader`: the monitor's own ``stability.jsonl``, and flat JSON-lines metric logs.

The monitor writes one strict-JSON object per line (see `StepRecord.to_json`,
`Finding.to_json`); non-finite floats are the strings ``"nan"``, ``"inf"`` and ``"-inf"``::

    {"type":"step","step":120,"values":{"loss":2.51,"grad_norm":0.83,"lr":"nan"}}
    {"type":"finding","kind":"loss_spike","step":118,...}

Step lines become records as written (keys are signal keys already). Finding lines are collected
in `JsonlReader.findings` (the first `MAX_FINDINGS`), not replayed. A flat object with a ``step``
(``{"step": 10, "train/loss": 2.5}``, as many trackers write) is read too, its names mapped
through the shared aliases. Lines that are not JSON objects are skipped, with one note that counts
them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import IO, Any, ClassVar

from stabilizer.core.records import Finding, StepRecord

from ._keys import KeyMap
from ._lines import text_chunks
from .base import BaseReader, Note, record

__all__ = ["MAX_FINDINGS", "JsonlReader"]

MAX_FINDINGS = 10_000
_FLOATS = {float}
_STARTS = frozenset('{["-0123456789tfnNI')  # what a JSON value (or NaN, Infinity) starts with
_BAD = (
    StopIteration, ValueError, TypeError, KeyError, AttributeError, RecursionError, OverflowError
)  # fmt: skip
_Scan = Callable[[str, int], tuple[Any, int]]


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
            if text.startswith(('{"type":"step"', '{"type": "step"', '{"type":"finding"')):
                return 1.0
            if text.startswith("{") and '"step"' in text and _object(text) is not None:
                best = 0.7
        return best

    def _records(self, stream: IO[bytes]) -> Iterator[StepRecord]:
        keys, last, bad, base = KeyMap(), -1, 0, 1
        # `JSONDecoder.raw_decode` without its Python frame: the C scanner it calls.
        scan: _Scan = json.JSONDecoder().scan_once  # type: ignore[attr-defined]
        step: int | None
        for lines in text_chunks(stream, self.notes):
            for lineno, line in enumerate(lines, base):
                if line[:1] != "{" and line.lstrip()[:1] not in _STARTS:  # no JSON: no raising
                    bad += bool(line.strip())
                    continue
                try:
                    data = scan(line, 0)[0] if line[:1] == "{" else json.loads(line)
                    if line.startswith('{"type":"step"'):  # the monitor's own: the fast path
                        step, values = data["step"], data["values"]
                        step = step if type(step) is int else _int(step)
                        if not _FLOATS.issuperset(map(type, values.values())):  # else: as they are
                            values = {k: float(v) for k, v in values.items()}
                    else:
                        step, values = self._parse(data, keys)
                except _BAD:
                    bad += bool(line.strip())
                    continue
                if step is None:
                    continue
                if step < last:
                    self.segment(step, last, "", lineno)
                last = step
                yield record(step, values)
            base += len(lines)
        if bad:
            self.note("skipped", f"{bad} line(s) not JSON records: skipped")

    def _parse(self, data: Any, keys: KeyMap) -> tuple[int | None, dict[str, float]]:
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
