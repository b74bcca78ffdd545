"""The data that flows through the engine: `StepRecord` in, `Finding` out.

Both serialise to one line of strict JSON (the run's JSONL log): non-finite floats are written as
the strings ``"nan"``, ``"inf"`` and ``"-inf"``, which any JSON parser accepts, and read back as
floats. Both compare NaN equal to NaN, so a record or finding equals its own round trip and a live
run's findings equal those of its replay.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from .remedies import REMEDIES  # the remedy table's names, re-exported

__all__ = ["REMEDIES", "Finding", "Severity", "StepRecord"]

_JOIN = ": "  # between what was seen and the advice, in `Finding.message`
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _encode(value: float) -> float | str:
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _decode(value: Any) -> float:
    if isinstance(value, str):
        if value not in _NONFINITE:
            raise ValueError(f"a value must be a number, 'nan', 'inf' or '-inf', got {value!r}")
        return _NONFINITE[value]
    return float(value)


def _floats(values: Mapping[str, Any]) -> dict[str, float]:
    return {str(key): float(value) for key, value in values.items()}


def _comparable(values: Mapping[str, float]) -> tuple[tuple[str, float | str], ...]:
    # NaN != NaN would make a record unequal to itself after a round trip; compare "nan" instead.
    return tuple(sorted((k, "nan" if math.isnan(v) else v) for k, v in values.items()))


def _require(data: Mapping[str, Any], kind: str, keys: tuple[str, ...]) -> None:
    if data.get("type", kind) != kind:
        raise ValueError(f"`type` must be {kind!r}, got {data.get('type')!r}")
    missing = [key for key in keys if key not in data]
    if missing:
        raise ValueError(f"a {kind} dict must have {', '.join(keys)}; missing {', '.join(missing)}")


class StepRecord:
    """The signals of one optimizer step.

    A plain class with slots, not a dataclass: every line of a log becomes one, and a frozen
    dataclass costs twice as much to build. Treat a record as read-only; it is shared by the
    engine, the history and every sink.

    Args:
        step: The global optimizer step.
        values: Plain floats keyed by the names in `stabilizer.core.signals`; any key may
            be missing.
    """

    __slots__ = ("step", "values")

    def __init__(self, step: int, values: Mapping[str, float] | None = None) -> None:
        self.step = int(step)
        self.values: Mapping[str, float] = _floats(values) if values else {}

    @classmethod
    def from_floats(cls, step: int, values: dict[str, float]) -> StepRecord:
        """The record of a dict the caller built for it and hands over: plain floats under str
        keys, kept as given, without the copy and conversion ``StepRecord(step, values)`` makes
        (a reader's hot path: the copy is most of a record's cost)."""
        record = cls.__new__(cls)
        record.step, record.values = step, values
        return record

    def __repr__(self) -> str:
        return f"StepRecord(step={self.step!r}, values={self.values!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepRecord):
            return NotImplemented
        return self.step == other.step and _comparable(self.values) == _comparable(other.values)

    def __hash__(self) -> int:
        return hash((self.step, _comparable(self.values)))

    def to_dict(self) -> dict[str, Any]:
        """A strict-JSON-able dict: ``{"type": "step", "step": N, "values": {...}}``."""
        values = {key: _encode(value) for key, value in self.values.items()}
        return {"type": "step", "step": self.step, "values": values}

    def to_json(self) -> str:
        """One line of strict JSON (see `to_dict`)."""
        return json.dumps(self.to_dict(), allow_nan=False, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepRecord:
        """The record of a `to_dict` dict (or a parsed `to_json` line).

        Raises:
            ValueError: ``type`` is not ``"step"``, a key is missing or a value is not a number.
        """
        _require(data, "step", ("step", "values"))
        return cls(int(data["step"]), {k: _decode(v) for k, v in data["values"].items()})


class Severity(IntEnum):
    """How bad a finding is. The values are those of the `logging` levels of the same names."""

    INFO = 20
    WARNING = 30
    ERROR = 40
    CRITICAL = 50

    @classmethod
    def parse(cls, name: str) -> Severity:
        """The severity named ``name``, in any case: ``Severity.parse("warning")``.

        Raises:
            ValueError: ``name`` is not a severity; the message lists the valid names.
        """
        try:
            return cls[name.strip().upper()]
        except KeyError:
            valid = ", ".join(member.name.lower() for member in cls)
            raise ValueError(f"`severity` must be one of {valid}, got {name!r}") from None


@dataclass(frozen=True, eq=False)
class Finding:
    """One diagnosed episode: what happened, when, how bad, the numbers, and what to do.

    Its parts are fields, and every output renders them: the console and the reports show what
    was `seen` beside the `remedies` (which say the `advice` again), one-line outputs show the
    whole `message`.

    Args:
        kind: What was found, a row of `stabilizer.core.kinds` (``"loss_spike"``, ...).
        step: The step the episode started.
        end_step: The last step the finding covers, or None when not known.
        severity: How bad it is.
        seen: What was seen, one line (``"loss spiked from 2.5 to 7.5 (3.0x) at step 121"``).
        evidence: The numbers behind the decision (baseline, peak, ratio, ...).
        location: Module or depth-group names, when known.
        remedies: Suggested remedy names (see `REMEDIES`), most useful first.
        advice: What to do in a few words (``"clip gradients (norm 1.0)"``), as the remedies say
            it again; "" for none.
    """

    kind: str
    step: int
    end_step: int | None
    severity: Severity
    seen: str
    evidence: Mapping[str, float] = field(default_factory=dict)
    location: tuple[str, ...] = ()
    remedies: tuple[str, ...] = ()
    advice: str = ""

    def __post_init__(self) -> None:
        for name in ("seen", "advice"):
            text = getattr(self, name)
            if "\n" in text or "\r" in text:
                raise ValueError(f"`{name}` must be one line, got {text!r}")
        object.__setattr__(self, "step", int(self.step))
        if self.end_step is not None:
            object.__setattr__(self, "end_step", int(self.end_step))
        object.__setattr__(self, "severity", Severity(self.severity))
        object.__setattr__(self, "evidence", _floats(self.evidence))
        object.__setattr__(self, "location", tuple(self.location))
        object.__setattr__(self, "remedies", tuple(self.remedies))

    @property
    def message(self) -> str:
        """The whole line: what was seen, then the advice after ``": "``."""
        return f"{self.seen}{_JOIN}{self.advice}" if self.advice else self.seen

    @property
    def observation(self) -> str:
        """What was seen, when the remedies carry the advice; else the whole message.

        ``"loss spiked from 2.5 to 7.5 (3.0x) at step 121, back after 8 steps"`` for the message
        ``"...back after 8 steps: clip gradients (norm 1.0)"``.
        """
        return self.seen if self.remedies else self.message

    def __str__(self) -> str:
        """One line for a human: step range, severity, kind, location, message, remedies.

        ``steps 200-203 warning loss_spike: loss spiked ... -> try: clip_gradients, rollback``
        """
        span = f"steps {self.step}-{self.end_step}"
        if self.end_step in (None, self.step):
            span = f"step {self.step}"
        where = f" [{', '.join(self.location)}]" if self.location else ""
        fix = f" -> try: {', '.join(self.remedies)}" if self.remedies else ""
        return f"{span} {self.severity.name.lower()} {self.kind}{where}: {self.message}{fix}"

    def _key(self) -> tuple[Any, ...]:
        head = (self.kind, self.step, self.end_step, self.severity, self.seen, self.advice)
        return (*head, _comparable(self.evidence), self.location, self.remedies)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Finding):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def to_dict(self) -> dict[str, Any]:
        """A strict-JSON-able dict with ``"type": "finding"``; severity by lower-case name.

        ``message`` is the whole line (what readers before the parts were fields read); a
        finding with advice has ``advice`` too, the end of the message after ``": "``.
        """
        data = {
            "type": "finding",
            "kind": self.kind,
            "step": self.step,
            "end_step": self.end_step,
            "severity": self.severity.name.lower(),
            "message": self.message,
            "evidence": {key: _encode(value) for key, value in self.evidence.items()},
            "location": list(self.location),
            "remedies": list(self.remedies),
        }
        if self.advice:
            data["advice"] = self.advice
        return data

    def to_json(self) -> str:
        """One line of strict JSON (see `to_dict`)."""
        return json.dumps(self.to_dict(), allow_nan=False, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Finding:
        """The finding of a `to_dict` dict (or a parsed `to_json` line); a dict without
        ``advice`` (one written before the parts were fields, too) has its message as `seen`.

        Raises:
            ValueError: ``type`` is not ``"finding"``, a key is missing or a value is invalid.
        """
        _require(data, "finding", ("kind", "step", "end_step", "severity", "message"))
        end_step, message = data["end_step"], str(data["message"])
        advice = str(data.get("advice") or "")
        seen = message.removesuffix(_JOIN + advice) if advice else message
        if advice and len(seen) == len(message):
            raise ValueError(f"`advice` must end the message, got {advice!r}")
        return cls(
            kind=str(data["kind"]),
            step=int(data["step"]),
            end_step=None if end_step is None else int(end_step),
            severity=Severity.parse(str(data["severity"])),
            seen=seen,
            evidence={k: _decode(v) for k, v in data.get("evidence", {}).items()},
            location=tuple(data.get("location", ())),
            remedies=tuple(data.get("remedies", ())),
            advice=advice,
        )
