"""`JsonlWriter`: appends lines, and a resumed run's lines survive a line a crash cut short."""

from __future__ import annotations

from pathlib import Path

from stabilizer.core.records import StepRecord
from stabilizer.outputs.jsonl import JsonlWriter
from stabilizer.replay.readers import read_log


def test_appends_to_the_log_of_an_earlier_run(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "stability.jsonl"
    for steps in (range(3), range(2, 4)):  # a run, then a resumed run
        with JsonlWriter(path) as writer:
            for step in steps:
                writer.write(StepRecord(step, {"loss": 2.0}))
    assert path.read_text().count("\n") == 5
    assert [r.step for r in read_log(path)] == [0, 1, 2, 2, 3]


def test_a_line_cut_short_by_a_crash_costs_no_line_of_the_resumed_run(tmp_path: Path) -> None:
    path = tmp_path / "stability.jsonl"
    with JsonlWriter(path) as writer:
        writer.write(StepRecord(0, {"loss": 2.0}))
    with path.open("a") as crashed:  # the crash: half a line, no line end
        crashed.write(StepRecord(1, {"loss": 2.0}).to_json()[:20])
    with JsonlWriter(path) as writer:  # the resumed run
        writer.write(StepRecord(1, {"loss": 1.5}))
    stream = read_log(path)
    assert [(r.step, r.values["loss"]) for r in stream] == [(0, 2.0), (1, 1.5)]
    assert [n.message for n in stream.notes if n.kind == "skipped"] == [
        "1 line(s) not JSON records: skipped"
    ]
