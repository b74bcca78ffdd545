"""StepRecord, Finding and Severity: values, strict-JSON round trips, errors."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import pytest

from stabilizer.core.records import Finding, Severity, StepRecord


def _strict(line: str) -> Any:
    """Parse JSON refusing the NaN/Infinity extensions, as strict parsers do."""

    def refuse(token: str) -> None:
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(line, parse_constant=refuse)


def _finding(**changes: Any) -> Finding:
    fields: dict[str, Any] = {
        "kind": "loss_spike",
        "step": 100,
        "end_step": 103,
        "severity": Severity.WARNING,
        "seen": "loss spiked from 2.5 to 7.5 (3.0x) at step 101, back after 4 steps",
        "evidence": {"baseline": 2.5, "peak": 7.5, "peak_step": 101.0, "ratio": 3.0},
        "location": ("block_03",),
        "remedies": ("clip_gradients", "rollback"),
    }
    fields.update(changes)
    return Finding(**fields)


def test_step_record_json_line() -> None:
    record = StepRecord(3, {"loss": 2.5, "grad_norm": math.nan, "up": math.inf, "down": -math.inf})
    line = record.to_json()
    assert line == (
        '{"type":"step","step":3,"values":{"loss":2.5,"grad_norm":"nan","up":"inf","down":"-inf"}}'
    )
    assert "\n" not in line
    assert StepRecord.from_dict(_strict(line)) == record


def test_step_record_values_become_plain_floats_and_nan_equals_nan() -> None:
    record = StepRecord(1, {"skipped": True, "loss": 2})
    assert record.values == {"skipped": 1.0, "loss": 2.0}
    assert all(type(v) is float for v in record.values.values())
    assert StepRecord(1, {"loss": math.nan}) == StepRecord(1, {"loss": float("nan")})
    assert hash(StepRecord(1, {"loss": math.nan})) == hash(StepRecord(1, {"loss": math.nan}))
    assert StepRecord(1, {"loss": 1.0}) != StepRecord(2, {"loss": 1.0})
    assert StepRecord(0) == StepRecord(0, {})


@pytest.mark.parametrize(
    ("data", "match"),
    [
        pytest.param(
            {"type": "finding", "step": 1, "values": {}}, "`type` must be 'step'", id="type"
        ),
        pytest.param(
            {"step": 1}, "a step dict must have step, values; missing values", id="missing"
        ),
        pytest.param(
            {"step": 1, "values": {"loss": "NaN"}},
            "a value must be a number, 'nan', 'inf' or '-inf', got 'NaN'",
            id="bad-string",
        ),
    ],
)
def test_step_record_from_bad_dict(data: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StepRecord.from_dict(data)


def test_finding_round_trip_is_exact() -> None:
    finding = _finding(evidence={"loss": math.nan, "ratio": math.inf, "low": -math.inf, "x": 0.1})
    line = finding.to_json()
    data = _strict(line)
    assert data["type"] == "finding"
    assert data["severity"] == "warning"
    assert data["evidence"] == {"loss": "nan", "ratio": "inf", "low": "-inf", "x": 0.1}
    back = Finding.from_dict(data)
    assert back == finding
    assert hash(back) == hash(finding)
    assert (back.location, back.remedies) == (("block_03",), ("clip_gradients", "rollback"))


def test_finding_with_open_end_and_defaults() -> None:
    finding = Finding("nonfinite_loss", 7, None, Severity.ERROR, "loss is nan at step 7")
    assert finding.to_dict()["end_step"] is None
    assert Finding.from_dict(json.loads(finding.to_json())) == finding
    assert (finding.evidence, finding.location, finding.remedies) == ({}, (), ())


@pytest.mark.parametrize(
    "change",
    [
        {"kind": "divergence"},
        {"step": 99},
        {"end_step": None},
        {"severity": Severity.ERROR},
        {"seen": "other"},
        {"advice": "clip gradients"},
        {"evidence": {"baseline": 2.5}},
        {"location": ()},
        {"remedies": ("rollback",)},
    ],
    ids=lambda change: next(iter(change)),
)
def test_findings_compare_by_every_field(change: dict[str, Any]) -> None:
    assert _finding() == _finding()
    assert _finding(**change) != _finding()


def test_finding_message_must_be_one_line() -> None:
    with pytest.raises(ValueError, match="`seen` must be one line, got 'a\\\\nb'"):
        _finding(seen="a\nb")
    with pytest.raises(ValueError, match="`advice` must be one line, got 'a\\\\rb'"):
        _finding(advice="a\rb")


def test_finding_parts_are_fields_and_its_message_joins_them() -> None:
    finding = _finding(advice="clip gradients (norm 1.0)")
    assert finding.message == finding.seen + ": clip gradients (norm 1.0)"
    data = _strict(finding.to_json())
    assert data["message"] == finding.message  # whole, as readers before the fields read it
    assert data["advice"] == "clip gradients (norm 1.0)"
    assert Finding.from_dict(data) == finding
    assert "advice" not in _finding().to_dict()  # none: the message is what was seen


def test_a_finding_written_before_the_fields_reads_whole_as_what_was_seen() -> None:
    old = {  # a line of a stability.jsonl written before findings had their parts as fields
        "type": "finding", "kind": "loss_spike", "step": 200, "end_step": 203,
        "severity": "warning", "message": "loss spiked ... back after 4 steps: clip gradients",
        "evidence": {}, "location": [], "remedies": ["clip_gradients"],
    }  # fmt: skip
    finding = Finding.from_dict(old)
    assert (finding.seen, finding.advice) == (old["message"], "")
    assert finding.message == old["message"]


def test_advice_that_does_not_end_the_message_is_refused() -> None:
    data = {**_finding(advice="clip").to_dict(), "advice": "roll back"}
    with pytest.raises(ValueError, match="`advice` must end the message, got 'roll back'"):
        Finding.from_dict(data)


def test_finding_from_bad_dict() -> None:
    with pytest.raises(ValueError, match="`type` must be 'finding', got 'step'"):
        Finding.from_dict({**_finding().to_dict(), "type": "step"})
    with pytest.raises(ValueError, match="missing severity, message"):
        Finding.from_dict({"kind": "x", "step": 1, "end_step": None})
    with pytest.raises(ValueError, match="`severity` must be one of"):
        Finding.from_dict({**_finding().to_dict(), "severity": "fatal"})


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("info", Severity.INFO),
        ("WARNING", Severity.WARNING),
        (" Error ", Severity.ERROR),
        ("critical", Severity.CRITICAL),
    ],
    ids=["lower", "upper", "padded-mixed", "critical"],
)
def test_severity_parse(name: str, expected: Severity) -> None:
    assert Severity.parse(name) is expected


@pytest.mark.parametrize("name", ["warn", "", "fatal"], ids=["warn", "empty", "fatal"])
def test_severity_parse_error_lists_valid_names(name: str) -> None:
    match = f"`severity` must be one of info, warning, error, critical, got '{name}'"
    with pytest.raises(ValueError, match=match):
        Severity.parse(name)


def test_severity_orders_and_matches_logging_levels() -> None:
    assert Severity.INFO < Severity.WARNING < Severity.ERROR < Severity.CRITICAL
    assert [int(s) for s in Severity] == [
        logging.INFO,
        logging.WARNING,
        logging.ERROR,
        logging.CRITICAL,
    ]


@pytest.mark.parametrize(
    ("finding", "line"),
    [
        pytest.param(
            Finding("nonfinite_loss", 7, 7, Severity.ERROR, "loss is nan at step 7"),
            "step 7 error nonfinite_loss: loss is nan at step 7",
            id="one-step",
        ),
        pytest.param(
            Finding("loss_spike", 200, None, Severity.WARNING, "up", remedies=("rollback",)),
            "step 200 warning loss_spike: up -> try: rollback",
            id="no-end",
        ),
        pytest.param(
            Finding(
                "depth_imbalance",
                104,
                153,
                Severity.WARNING,
                "starved",
                location=("block_00", "block_01"),
                remedies=("swap_to_pre_ln", "scale_lr"),
            ),
            "steps 104-153 warning depth_imbalance [block_00, block_01]: starved "
            "-> try: swap_to_pre_ln, scale_lr",
            id="range-location-remedies",
        ),
    ],
)
def test_finding_str_is_one_line_for_a_human(finding: Finding, line: str) -> None:
    assert str(finding) == line
