"""The reports' advice follows the evidence; one event is one episode; each remedy said once."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from stabilizer.core.detectors.loss_spike import LossSpike
from stabilizer.core.records import Finding, Severity, StepRecord
from stabilizer.replay.diagnose import Diagnosis, Located, Segment, diagnose
from stabilizer.report import report_dict
from stabilizer.report.incidents import incidents
from stabilizer.report.markdown import render_markdown
from stabilizer.report.text import render_text

sys.path.insert(0, str(Path(__file__).parent))

from test_report import SPIKE  # the same spike the report tests use

GRAD_SPIKE = Finding(
    "grad_spike",
    119,
    120,
    Severity.WARNING,
    "gradient norm spiked to 40 (20x the 2 baseline) at step 119, back after 1 step",
    {"baseline": 2.0, "peak": 40.0, "ratio": 20.0, "peak_step": 119},
    (),
    ("clip_gradients",),
    advice="clip the gradient norm near its usual level",
)
OVERFLOW = Finding(
    "fp16_overflow",
    60,
    62,
    Severity.ERROR,
    "fp16 overflow cascade: 3 skipped steps since step 60, loss scale 65536 -> 16384",
    {"skipped": 3.0},
    (),
    ("upcast_to_fp32", "skip_step"),
    advice="train in bf16 or run LayerNorm/softmax in fp32",
)
NAN = Finding(
    "nonfinite_loss",
    60,
    60,
    Severity.ERROR,
    "loss is nan at step 60",
    {"loss": math.nan},
    (),
    ("skip_step", "upcast_to_fp32", "rollback"),
    advice="skip the step; if it recurs, run LayerNorm/softmax in fp32",
)


def _diagnosis(*found: Finding) -> Diagnosis:
    segment = Segment(1, 0, 400, records=401)
    return Diagnosis("run.log", "jsonl", [], [segment], [Located(1, f) for f in found])


def test_a_loss_spike_and_the_gradient_spike_at_its_start_are_one_episode() -> None:
    [incident] = incidents(_diagnosis(SPIKE, GRAD_SPIKE))
    assert incident.worst.kind == "loss_spike"  # the loss spike titles it
    assert (incident.start, incident.end) == (119, 128)
    assert incident.remedies == ("clip_gradients", "rollback")
    text = render_text(_diagnosis(SPIKE, GRAD_SPIKE))
    assert "timeline: 1 episode" in text
    assert "loss spiked from 2.5" in text and "gradient norm spiked to 40" in text


def test_an_fp16_overflow_and_its_nan_are_one_episode() -> None:
    [incident] = incidents(_diagnosis(OVERFLOW, NAN))
    assert incident.worst.kind == "nonfinite_loss"


def test_events_apart_stay_apart() -> None:
    later = Finding("loss_spike", 300, 305, Severity.WARNING, "loss spiked", {}, (), ())
    assert len(incidents(_diagnosis(SPIKE, later, NAN))) == 3


@pytest.mark.parametrize("render", [render_text, render_markdown], ids=["text", "markdown"])
def test_each_remedy_is_said_once_per_episode(render: object) -> None:
    out = render(_diagnosis(SPIKE, GRAD_SPIKE))  # type: ignore[operator]
    timeline = out.split("erdict")[0]
    assert "clip gradients" not in timeline  # the detectors' own advice is not repeated
    assert "clip the gradient norm near" not in timeline
    assert timeline.count("clip the global gradient norm to 1.0") == 1


def test_a_spike_back_after_one_step_reads_in_the_singular() -> None:
    detector = LossSpike()
    found = []
    for step in range(120):
        loss = 2.0 + 0.01 * math.sin(step) + (8.0 if step == 100 else 0.0)
        found += detector.update(StepRecord(step, {"loss": loss}))
    [spike] = [f for f in found if f.kind == "loss_spike"]
    assert "back after 1 step:" in spike.message


def test_a_nan_made_in_the_loss_of_a_protected_fp32_run(tmp_path: Path) -> None:
    """A real run: the NaN comes from the loss (every module output finite), the guard skips
    the step, the run is fp32 and goes on. The report blames the loss computation, offers no
    fp32 islands, no fp16, no "skip the step", and (#33) no "roll back": the weights never took
    the step, and the run recovered."""
    from test_console import TinyLM, _fit

    _fit(tmp_path, TinyLM(nan_every=8), steps=10)  # a NaN loss at step 6, made after the model
    diagnosis = diagnose(str(tmp_path))  # the run directory: its stability.jsonl
    [incident] = [e for e in incidents(diagnosis) if e.worst.kind == "nonfinite_loss"]
    assert {f.kind for f in incident.findings} == {"nonfinite_loss", "root_cause"}
    assert "the loss computation or its inputs" in incident.cause
    assert "upcast_to_fp32" not in incident.remedies
    assert "skip_step" not in incident.remedies  # the guard skipped the step
    assert incident.recovered and incident.remedies == ()
    text = render_text(diagnosis)
    [block] = [b for b in text.split("\n#") if "non-finite loss" in b]
    assert "fp16" not in block and "fp32" not in block
    assert "roll back" not in text  # not in the episode, nor in the verdict


def _overflow_log(path: Path) -> Path:
    """An fp16 run's JSONL: the scaler skips steps 60-63 (NaN loss, the scale halving), then
    the scale holds: the cascade detector's ERROR, then its INFO when it is over."""
    lines = []
    for step in range(120):
        bad = 60 <= step < 64
        scale = 65536.0 / 2 ** min(max(step - 59, 0), 4)
        values = {"loss": math.nan if bad else 2.0, "loss_scale": scale, "skipped": float(bad)}
        lines.append(StepRecord(step, values).to_json())
    path.write_text("\n".join(lines) + "\n")
    return path


def test_an_episode_is_one_entry_in_every_report(tmp_path: Path) -> None:
    """#21: the cascade was an ERROR and then an INFO, two entries; the episode is one, at the
    worst severity it reached, with what it is now (over)."""
    diagnosis = diagnose(str(_overflow_log(tmp_path / "stability.jsonl")))
    [overflow] = [
        item.finding for item in diagnosis.findings if item.finding.kind == "fp16_overflow"
    ]
    assert overflow.severity == Severity.ERROR and "over, the scale holds" in overflow.message
    [incident] = incidents(diagnosis)
    assert [f.kind for f in incident.findings].count("fp16_overflow") == 1
    text = render_text(diagnosis)
    assert text.count("fp16 overflow cascade:") == 1
    assert "outcome   recovered: the run went on past step 63" in text
    assert "never recovers" not in text  # #21: said of a run that recovered
    report = report_dict([diagnosis], Severity.WARNING)
    assert [f["severity"] for f in report["findings"] if f["kind"] == "fp16_overflow"] == ["error"]


def test_a_spike_of_several_bad_steps_is_not_blamed_on_one_batch() -> None:
    five = Finding(
        "loss_spike", 150, 154, Severity.WARNING, "loss spiked", {"recovered": 1.0}, (), ()
    )
    [incident] = incidents(_diagnosis(five))
    assert incident.cause.startswith("the loss stayed up from step 150 to 154, not for one step")
    assert "one batch" not in incident.cause and incident.cause.endswith("the run recovered")
    single = Finding("loss_spike", 150, 150, Severity.WARNING, "loss spiked", {"recovered": 0.0})
    [one] = incidents(_diagnosis(single))
    assert one.cause == (
        "one batch with an outsized gradient pushed the weights off course; not back by the end "
        "of the log"
    )


def test_set_up_advice_is_no_episode(tmp_path: Path) -> None:
    """#21: the preflight's "no gradient clipping" was episode #1 of every healthy report."""
    clip = Finding(
        "config_risk",
        0,
        None,
        Severity.INFO,
        "no gradient clipping: one bad batch ...",
        {},
        (),
        ("clip_gradients",),
    )
    diagnosis = _diagnosis(clip, SPIKE)
    assert [e.worst.kind for e in incidents(diagnosis)] == ["loss_spike"]
    text = render_text(diagnosis)
    timeline, setup = text.split("\nset-up: the monitor's checks at the first batch\n")
    assert "#1" in timeline and "no gradient clipping" not in timeline
    assert setup.splitlines()[0] == (
        "    INFO  no gradient clipping: one bad batch ... -> clip the global gradient norm to "
        "1.0 (clip_gradients)"
    )
    assert text.splitlines()[-1].endswith("; 1 set-up note (1 info)")  # (printed above it)
    healthy = render_text(_diagnosis(clip))
    assert "timeline" not in healthy
    assert healthy.splitlines()[-1] == (
        "verdict: healthy: no instabilities found in 401 records; 1 set-up note (1 info)"
    )
    assert "### Set-up" in render_markdown(_diagnosis(clip))
