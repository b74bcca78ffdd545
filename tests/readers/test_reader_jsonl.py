"""`JsonlReader`: the monitor's own JSONL, round trips, findings lines, flat metric lines."""

from __future__ import annotations

import math

from reader_cases import findings, kinds, parse, parse_items, records, restarts, serious

from stabilizer.core.records import Finding, Severity, StepRecord
from stabilizer.replay.readers import JsonlReader, Note


def test_healthy_fixture_reads_and_is_healthy() -> None:
    recs = records("jsonl_healthy.jsonl")
    assert [r.step for r in recs] == list(range(300))
    assert set(recs[0].values) == {
        "loss",
        "grad_norm",
        "lr",
        *(f"grad_norm/block_{i:02d}" for i in range(4)),
    }
    assert 9.0 < recs[0].values["loss"] < 11.0 and recs[0].values["lr"] == 3e-4
    assert not serious(findings(recs))


def test_failing_fixture_has_nan_and_is_found() -> None:
    recs = records("jsonl_failing.jsonl")
    assert math.isnan(recs[200].values["loss"]) and math.isfinite(recs[199].values["loss"])
    assert kinds(findings(recs)) == {"nonfinite_loss"}


def test_round_trip_of_records_and_findings_in_log_order() -> None:
    written = [
        StepRecord(1, {"loss": 2.5, "grad_norm": math.inf}),
        StepRecord(2, {"loss": math.nan, "loss_scale": 1024.0, "skipped": 1.0}),
    ]
    finding = Finding("nonfinite_loss", 2, 2, Severity.ERROR, "loss is nan", {"loss": math.nan})
    text = "\n".join([written[0].to_json(), finding.to_json(), written[1].to_json()])
    reader = JsonlReader()
    import io

    assert list(reader.read(io.BytesIO(text.encode()))) == [written[0], finding, written[1]]


def test_flat_metric_lines_and_junk() -> None:
    notes: list[Note] = []
    text = (
        '{"step": 5, "train/loss": 2.5, "lr": 0.1, "tag": "x"}\nnot json\n{"step": "x"}\n[1, 2]\n'
    )
    assert parse("jsonl", text, notes) == [StepRecord(5, {"loss": 2.5, "lr": 0.1})]
    assert [n.message for n in notes] == ["3 line(s) not JSON records: skipped"]


def test_step_going_back_is_a_restart() -> None:
    lines = [StepRecord(s, {"loss": 1.0}).to_json() for s in (1, 2, 3, 2, 3)]
    notes: list[Note] = []
    found = parse_items("jsonl", "\n".join(lines), notes)
    assert [getattr(item, "step", None) for item in found] == [1, 2, 3, 2, 2, 3]
    assert restarts(found) == [(2, 4, "step went back from 3 to 2")]
    assert not notes


def test_an_array_written_an_entry_a_line_reads() -> None:
    """Text after a line's object (an array's comma) does not hide the object."""
    text = '[\n{"step": 1, "loss": 2.5},\n{"step": 2, "loss": 2.4}\n]\n'
    notes: list[Note] = []
    assert [r.step for r in parse("jsonl", text, notes)] == [1, 2]
    assert [n.message for n in notes] == ["2 line(s) not JSON records: skipped"]
