"""The post-mortem report: advice table, bounded history, episodes, text/markdown/JSON rendering."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from stabilizer.core.advice import RunFacts
from stabilizer.core.kinds import KINDS
from stabilizer.core.records import REMEDIES, Finding, Severity, StepRecord
from stabilizer.replay.diagnose import MAX_KEYS
from stabilizer.replay.readers import Item, LogReadError, Note, read_log
from stabilizer.report import (
    REMEDY_TEXT,
    Diagnosis,
    Failure,
    History,
    Located,
    Segment,
    advice_for,
    diagnose,
    exit_code,
    incidents,
    inputs,
    remedy_text,
    render_markdown,
    render_text,
    report_dict,
    verdict,
)
from stabilizer.report.causes import cause_for
from stabilizer.report.inputs import progress_bar
from stabilizer.report.text import render_overall

FIXTURES = Path(__file__).parent / "fixtures" / "logs"

SPIKE = Finding(
    "loss_spike",
    120,
    128,
    Severity.WARNING,
    "loss spiked from 2.5 to 7.5 (3.0x) at step 121, back after 8 steps",
    {"baseline": 2.5, "peak": 7.5, "ratio": 3.0, "peak_step": 121},
    (),
    ("clip_gradients", "rollback"),
    advice="clip gradients",
)
NAN_FIRST = Finding(
    "nonfinite_loss",
    300,
    300,
    Severity.ERROR,
    "loss is nan at step 300",
    {"loss": math.nan},
    (),
    ("skip_step", "upcast_to_fp32", "rollback"),
    advice="skip the step",
)
NAN_STUCK = Finding(
    "nonfinite_loss",
    300,
    304,
    Severity.CRITICAL,
    "NaN/Inf loss persists for 5 steps since step 300: the run is not recovering",
    {"steps": 5.0},
    (),
    ("rollback", "upcast_to_fp32"),
)
STARVED = Finding(
    "depth_imbalance",
    50,
    99,
    Severity.WARNING,
    "input side: blocks 0-2 get 1e-03x the gradient of the rest | a pipe",
    {"ratio": 1000.0},
    ("block_00", "block_01", "block_02"),
    ("swap_to_pre_ln",),
)


def _diagnosis(
    findings: list[Located], segments: list[Segment] | None = None, notes: list[Note] | None = None
) -> Diagnosis:
    if segments is None:
        segments = [Segment(1, 0, 400, records=401, nonfinite=101, nonfinite_since=300)]
    return Diagnosis("run.log", "megatron", notes or [], segments, findings)


# --- the advice table --------------------------------------------------------------------------


def test_advice_covers_every_finding_kind() -> None:
    for kind in KINDS:
        assert advice_for(kind).title and advice_for(kind).cause


def test_advice_covers_every_remedy() -> None:
    assert set(REMEDIES) <= set(REMEDY_TEXT)
    assert "1.0" in remedy_text("clip_gradients")
    assert "bf16" in remedy_text("upcast_to_fp32")
    assert "pre-LN" in remedy_text("swap_to_pre_ln")


def test_advice_for_unknown_names_falls_back_to_the_name() -> None:
    assert advice_for("new_kind").title == "new kind"
    assert remedy_text("new_remedy") == "new_remedy"


# --- the bounded history -----------------------------------------------------------------------


def test_history_stays_bounded_on_a_million_points() -> None:
    history = History(capacity=64)
    for step in range(1_000_000):
        history.add(step, 1, {"loss": float(step % 1000), "lr": 1e-3, "ignored": 1.0})
    assert len(history.bins) <= 64
    assert history.records == 1_000_000
    assert sum(one.count for one in history.bins) == 1_000_000
    series = history.series("loss")
    assert max(series.high) == 999.0 and min(series.low) == 0.0
    assert series.steps[-1] == 999_999 and series.last[-1] == 999.0
    assert history.keys() == {"loss", "lr"}


def test_history_keeps_extremes_nonfinite_counts_and_segments() -> None:
    history = History(capacity=4)
    for step, loss in enumerate([1.0, 9.0, math.nan, 2.0, 3.0, 0.5, 4.0, 5.0, 6.0, 7.0]):
        history.add(step, 1 if step < 8 else 2, {"loss": loss})
    series = history.series("loss")
    assert max(series.high) == 9.0 and min(series.low) == 0.5
    assert sum(series.nonfinite) == 1
    assert series.segments[-1] == 2 and 1 in series.segments
    assert history.nonfinite_keys() == {"loss"}


def test_history_matrix_fills_gaps_and_marks_nonfinite() -> None:
    history = History(capacity=8)
    history.add(0, 1, {"grad_norm/block_00": 1.0})
    history.add(1, 1, {"grad_norm/block_01": 2.0})
    history.add(2, 1, {"grad_norm/block_00": math.inf, "grad_norm/block_01": 3.0})
    steps, rows = history.matrix(["block_00", "block_01"])
    assert steps == [0, 1, 2]
    assert rows[0][:2] == [1.0, 1.0] and math.isnan(rows[0][2])
    assert rows[1] == [2.0, 2.0, 3.0]
    assert history.groups() == ["block_00", "block_01"]


@pytest.mark.parametrize("capacity", [0, 1, 3], ids=["zero", "one", "odd"])
def test_history_rejects_bad_capacity(capacity: int) -> None:
    with pytest.raises(ValueError, match=r"`capacity` must be an even number >= 2, got"):
        History(capacity)


# --- episodes and the verdict ------------------------------------------------------------------


def test_findings_of_one_kind_and_start_are_one_episode() -> None:
    found = incidents(_diagnosis([Located(1, SPIKE), Located(1, NAN_FIRST), Located(1, NAN_STUCK)]))
    assert [e.worst.kind for e in found] == ["loss_spike", "nonfinite_loss"]
    nan = found[1]
    assert nan.worst is NAN_STUCK and nan.findings == (NAN_FIRST, NAN_STUCK)
    assert (nan.start, nan.end) == (300, 304)
    assert nan.remedies == ("rollback", "upcast_to_fp32", "skip_step")
    assert nan.evidence["steps"] == 5.0 and math.isnan(nan.evidence["loss"])


def test_verdict_names_the_worst_episode_and_its_first_remedy() -> None:
    line = verdict(_diagnosis([Located(1, SPIKE), Located(1, NAN_FIRST)]), Severity.WARNING)
    assert line.startswith("error: 2 episodes (1 error, 1 warning); act first on #2")
    assert remedy_text("skip_step") in line
    assert "\n" not in line


def test_verdict_healthy_below_fail_on_clean_segment_and_truncated() -> None:
    truncated = [Note("truncated", "truncated record at byte 10")]
    assert verdict(_diagnosis([], notes=truncated), Severity.WARNING).startswith(
        "healthy: no instabilities found in 401 records; the log is cut short"
    )
    below = verdict(_diagnosis([Located(1, SPIKE)]), Severity.ERROR)
    assert below.startswith("warning (below --fail-on error)")
    segments = [Segment(1, 0, 200, 201), Segment(2, 150, 400, 251, why="restart: x")]
    clean = verdict(_diagnosis([Located(1, SPIKE)], segments), Severity.WARNING)
    assert clean.endswith("segment 2, after the last restart, is clean")


def test_exit_code_by_fail_on() -> None:
    diagnosis = _diagnosis([Located(1, SPIKE), Located(1, NAN_FIRST)])
    assert exit_code(diagnosis, Severity.WARNING) == 1
    assert exit_code(diagnosis, Severity.ERROR) == 1
    assert exit_code(diagnosis, Severity.CRITICAL) == 0
    assert exit_code(Failure("x.log", "x.log: empty file"), Severity.CRITICAL) == 2


# --- rendering ---------------------------------------------------------------------------------


def test_text_report_layout() -> None:
    notes = [
        Note("format", "Megatron losses are averages over the log interval of 10", 13),
        *[Note("skipped", "over-long line skipped", line) for line in (40, 90, 120)],
    ]
    diagnosis = _diagnosis(
        [Located(1, STARVED), Located(1, SPIKE), Located(1, NAN_FIRST), Located(1, NAN_STUCK)],
        notes=notes,
    )
    text = render_text(diagnosis)
    lines = text.splitlines()
    assert lines[:3] == ["diagnosis of run.log", "format    megatron", "records   401, steps 0–400"]
    assert "notes     line 13: Megatron losses are averages over the log interval of 10" in lines
    assert "line 40: over-long line skipped (and 2 more like it)" in text
    assert "timeline: 3 episodes" in lines
    assert "#1  steps 50–99  WARNING  starved layers (depth imbalance)" in lines
    assert "    where     block_00, block_01, block_02" in lines
    assert "#3  steps 300–304  CRITICAL  non-finite loss (NaN/Inf)" in lines
    # No loss scale in the log: not known to be fp16, so no fp16 overflow is blamed.
    assert f"    cause     {cause_for('nonfinite_loss', [], RunFacts())}" in lines
    assert "fp16" not in cause_for("nonfinite_loss", [], RunFacts())
    assert "    evidence  steps 5, loss nan" in lines
    assert "never recovers: the loss is non-finite from step 300 to the end of the log" in text
    assert f"    remedy    {REMEDY_TEXT['rollback']} (rollback)" in lines
    assert lines[-1].startswith("verdict: critical: 3 episodes (1 critical, 2 warning)")


def test_text_report_lists_segments_of_a_restarted_run() -> None:
    segments = [
        Segment(1, 0, 200, 201),
        Segment(2, 150, 400, 251, why="restart: step went back from 200 to 150", line=230),
    ]
    text = render_text(_diagnosis([Located(2, SPIKE)], segments))
    assert "segments  2 (the run was restarted)" in text
    assert "2  steps 150–400, 251 records; line 230: restart: step went back" in text
    assert "WARNING  loss spike  (segment 2)" in text


def test_markdown_report_layout() -> None:
    markdown = render_markdown(_diagnosis([Located(1, STARVED), Located(1, NAN_STUCK)]))
    assert markdown.startswith("## Diagnosis of `run.log`\n\n| | |\n|---|---|\n| format |")
    assert "### Timeline" in markdown
    assert "#### #1 · steps 50–99 · WARNING · starved layers (depth imbalance)" in markdown
    assert "- **where:** `block_00`, `block_01`, `block_02`" in markdown
    assert "the rest \\| a pipe" in markdown  # table-safe
    assert f"- **likely cause:** {advice_for('depth_imbalance').cause}" in markdown
    assert "(`swap_to_pre_ln`)" in markdown
    assert markdown.splitlines()[-1].startswith("**Verdict:** critical")


def test_json_report_is_strict_json_with_inputs_findings_summary() -> None:
    diagnosis = _diagnosis([Located(1, SPIKE), Located(1, NAN_FIRST)])
    data = report_dict([diagnosis, Failure("gone.log", "gone.log: empty file")], Severity.WARNING)
    data = json.loads(json.dumps(data, allow_nan=False))
    first, failed = data["inputs"]
    assert first["format"] == "megatron" and first["records"] == 401
    assert first["steps"] == {"first": 0, "last": 400}
    assert first["segments"][0]["nonfinite_since"] == 300
    assert first["summary"] == {
        "findings": 2,
        "counts": {"critical": 0, "error": 1, "warning": 1, "info": 0},
        "worst": "error",
        "exit_code": 1,
    }
    assert failed == {
        "path": "gone.log",
        "error": "gone.log: empty file",
        "summary": {"exit_code": 2},
    }
    assert [f["kind"] for f in data["findings"]] == ["loss_spike", "nonfinite_loss"]
    assert data["findings"][1]["evidence"]["loss"] == "nan"
    assert Finding.from_dict(data["findings"][0]) == SPIKE
    assert data["summary"]["exit_code"] == 2 and data["summary"]["unreadable"] == 1
    assert data["summary"]["worst"] == "error" and data["summary"]["fail_on"] == "warning"


def test_overall_line() -> None:
    outcomes: list[Diagnosis | Failure] = [_diagnosis([Located(1, SPIKE)]), Failure("x", "x: e")]
    line = render_overall(outcomes, Severity.WARNING)
    assert line == "overall: 2 inputs, 1 unreadable, worst finding: warning; exit status 2"


# --- diagnose(): segments get a fresh engine ---------------------------------------------------


def _jsonl(steps: list[int], losses: list[float]) -> str:
    return "".join(
        StepRecord(s, {"loss": v}).to_json() + "\n" for s, v in zip(steps, losses, strict=True)
    )


def test_diagnose_splits_a_restarted_run_into_segments(tmp_path: Path) -> None:
    steps = list(range(0, 60)) + list(range(40, 100))
    losses = [2.0 + 0.01 * (s % 3) for s in steps]
    losses[50] = math.nan  # segment 1, step 50
    log = tmp_path / "stability.jsonl"
    log.write_text(_jsonl(steps, losses))
    diagnosis = diagnose(str(log))
    assert diagnosis.format == "jsonl"
    assert [(s.first_step, s.last_step, s.records) for s in diagnosis.segments] == [
        (0, 59, 60),
        (40, 99, 60),
    ]
    assert "step went back from 59 to 40" in diagnosis.segments[1].why
    assert {(segment, f.kind, f.step) for segment, f in diagnosis.findings} == {
        (1, "nonfinite_loss", 50)
    }
    assert diagnosis.history.records == 120


class _Bar:
    """Stands in for a click progress bar: what `progress_bar` moved it by."""

    def __init__(self) -> None:
        self.moves: list[int] = []

    def update(self, n: int) -> None:
        self.moves.append(n)


def test_progress_bar_moves_by_bytes_of_the_input(tmp_path: Path) -> None:
    path = tmp_path / "train.log.gz"
    path.write_bytes(gzip.compress((FIXTURES / "nanogpt_healthy.log").read_bytes() * 50))
    stream, bar = read_log(str(path)), _Bar()
    assert stream.format == "generic" and stream.total_bytes == path.stat().st_size
    recs = list(inputs._shown(stream, lambda: bar, 0.0))  # type: ignore[arg-type]
    assert recs == list(read_log(str(path)))
    assert sum(bar.moves) == path.stat().st_size and len(bar.moves) > 2


def test_progress_bar_wraps_a_log_and_an_iterator() -> None:
    out = io.StringIO()
    with contextlib.ExitStack() as stack:
        wrap = progress_bar("reading log", stack, out, delay=0.0)
        assert len(list(wrap(read_log(str(FIXTURES / "nanogpt_healthy.log"))))) == 600
        assert len(list(wrap(iter([StepRecord(1, {"loss": 1.0})])))) == 1
    assert out.getvalue().startswith("reading log")


def test_diagnose_a_restarted_tensorboard_run(tmp_path: Path) -> None:
    from stabilizer.outputs.tensorboard import EventWriter, scalar_summary

    with EventWriter(str(tmp_path)) as writer:
        for step in [*range(200), *range(50, 250)]:
            loss = 2.0 + 0.01 * (step % 3) + (5.0 if step == 220 else 0.0)
            writer.add_summary(scalar_summary({"loss": loss}), step)
    diagnosis = diagnose(str(tmp_path))
    assert [(s.first_step, s.last_step, s.records) for s in diagnosis.segments] == [
        (0, 199, 200),
        (50, 249, 200),
    ]
    assert [(segment, f.kind, f.step) for segment, f in diagnosis.findings] == [
        (2, "loss_spike", 220)
    ]


def test_diagnose_a_tensorboard_session_start(tmp_path: Path) -> None:
    """A ``session_log`` START after records splits the run, though the steps go on."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(str(tmp_path))
    for step in range(200):
        if step == 120:
            start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            writer.add_event(event_pb2.Event(wall_time=1.0, step=step, session_log=start))
        value = summary_pb2.Summary.Value(tag="loss", simple_value=2.0 + 0.01 * (step % 3))
        writer.add_event(event_pb2.Event(step=step, summary=summary_pb2.Summary(value=[value])))
    writer.close()
    diagnosis = diagnose(str(tmp_path))
    assert [(s.first_step, s.last_step, s.records) for s in diagnosis.segments] == [
        (0, 119, 120),
        (120, 199, 80),
    ]
    assert diagnosis.segments[1].why == (
        "restart: a new session started (session_log START) (segment 2)"
    )


def test_summary_step_range_is_lowest_to_highest(tmp_path: Path) -> None:
    """Regression: the summary gave the first segment's first step to the last one's last step
    (``steps 1–-9223372036854775809``)."""
    steps = [*range(1, 11), -(2**63) - 1, 5, 6, 7]
    log = tmp_path / "stability.jsonl"
    log.write_text(_jsonl(steps, [2.0] * len(steps)))
    diagnosis = diagnose(str(log))
    assert diagnosis.steps == (-(2**63) - 1, 10)
    assert render_text(diagnosis).splitlines()[2] == ("records   14, steps -9223372036854775809–10")
    log.write_text(_jsonl([*range(1, 11), 5, 6, 7], [2.0] * 13))
    assert diagnose(str(log)).steps == (1, 10)


def test_a_log_of_ever_new_keys_keeps_the_first_max_keys(tmp_path: Path) -> None:
    """Regression (#15): records each carrying 200 new ``grad_norm/*`` keys made every later
    record cost every key seen (10,000 records: 133 s, 648 MB). The first `MAX_KEYS` distinct
    keys are kept, with one note; memory is bounded."""
    log = tmp_path / "stability.jsonl"
    with log.open("w") as out:
        for step in range(600):
            values = {"loss": 2.0, **{f"grad_norm/g{step}_{k}": 1.0 for k in range(200)}}
            out.write(StepRecord(step, values).to_json() + "\n")
    tracemalloc.start()
    try:
        diagnosis = diagnose(str(log))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert diagnosis.records == 600
    assert len(diagnosis.history.keys()) == MAX_KEYS  # loss and the first 4095 norms
    assert sum(len(one.series) for one in diagnosis.history.bins) < 2 * MAX_KEYS
    (note,) = [n for n in diagnosis.notes if "distinct keys" in n.message]
    assert note == Note(
        "skipped", f"more than {MAX_KEYS} distinct keys: later new keys are dropped", None, 20
    )
    assert peak < 64 << 20


def test_history_time_goes_with_each_records_keys() -> None:
    """A record is folded into the bin it lands in only: bins hold the keys of their records."""
    history = History(capacity=8)
    for step in range(64):
        history.add(step, 1, {"loss": 1.0, f"grad_norm/g{step}": 1.0, "ignored": 1.0})
    assert history.width == 8 and len(history.bins) == 8
    assert [len(one.series) for one in history.bins] == [9] * 8  # loss and its 8 records' norms


def test_records_read_before_a_reader_gives_up_are_diagnosed() -> None:
    def failing(records: Iterator[Item]) -> Iterator[Item]:
        for count, record in enumerate(records):
            if count == 30:
                raise LogReadError("nanogpt reader failed: boom")
            yield record

    diagnosis = diagnose(str(FIXTURES / "nanogpt_healthy.log"), wrap=failing)
    assert diagnosis.records == 30
    assert diagnosis.history.records == 30
    assert diagnosis.notes[-1] == Note("truncated", "stopped reading: nanogpt reader failed: boom")
