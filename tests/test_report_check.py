"""Reports never contradict themselves (#41): the one check at the end of every report, run over
every report the scenarios, the fixtures and the real logs make.

`stabilizer.report.check.check` reads a rendered report against its diagnosis: a recovery the
log refutes (the loss non-finite to the end) is never said; advice fits the run's precision
("switch to bf16" is no advice to a run in bf16 or with no fp16 scaler, fp32 islands none to
an fp32 run); the verdict does not point below at notes printed above it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import TracedRun
from stabilizer.core.run import RunHeader
from stabilizer.demo.scenarios import SCENARIOS
from stabilizer.replay.diagnose import Diagnosis, Located, diagnose
from stabilizer.replay.readers import LogReadError
from stabilizer.report import render_markdown, render_text
from stabilizer.report.check import check

pytestmark = pytest.mark.xdist_group("scenarios")  # one worker trains each scenario once

TESTS = Path(__file__).parent
LOGS = sorted(
    [
        *(TESTS / "fixtures" / "real" / "logs").iterdir(),
        *(path for path in (TESTS / "fixtures" / "logs").iterdir() if path.suffix != ".py"),
        *(TESTS.parent / "examples" / "logs").iterdir(),
    ]
)


def _hf_log(tmp_path: Path, last: int = 60) -> Path:
    """An HF Trainer log whose loss spikes at step 50 and then goes NaN, which the Trainer logs
    as ``'loss': 0.0`` (its ``logging_nan_inf_filter``) beside a NaN gradient norm."""
    lines = []
    for step in range(1, last + 1):
        loss, norm = (9.0, "40.0") if step == 50 else (2.5 - step * 0.005, "0.5")
        if step > 50:
            loss, norm = 0.0, "nan"
        lines.append(
            f"{{'loss': {loss}, 'grad_norm': {norm}, 'learning_rate': 0.0001, "
            f"'epoch': {step / 100:.2f}}}"
        )
    path = tmp_path / "hf_spike_then_nan.log"
    path.write_text("\n".join(lines) + "\n")
    return path


def _reports(diagnosis: Diagnosis) -> list[str]:
    return [render_text(diagnosis), render_markdown(diagnosis)]


@pytest.mark.parametrize("log", LOGS, ids=[log.name for log in LOGS])
def test_no_report_of_a_fixture_or_real_log_contradicts_itself(log: Path) -> None:
    try:
        diagnosis = diagnose(str(log))
    except LogReadError:
        pytest.skip("no training records")
    for text in _reports(diagnosis):
        assert check(diagnosis, text) == [], text


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_no_report_of_a_scenario_contradicts_itself(
    name: str, scenario_run: Callable[[str], TracedRun]
) -> None:
    traced = scenario_run(name)
    for path in (traced.log_dir / "stability.jsonl", traced.log_dir):
        diagnosis = diagnose(str(path))
        for text in _reports(diagnosis):
            assert check(diagnosis, text) == [], text


@pytest.mark.parametrize("last", [60, 52], ids=["long tail", "short tail"])
def test_a_spike_the_hidden_nan_followed_is_no_recovery(tmp_path: Path, last: int) -> None:
    """#41: the spike said "back after 1 step ... the run recovered" beside the NaN's "never
    recovers": its "back" was the HF Trainer's 0.0 for a NaN loss."""
    diagnosis = diagnose(str(_hf_log(tmp_path, last)))
    text = render_text(diagnosis)
    spike = text.split("#1  ")[1].split("\n#2  ")[0]
    assert "the run recovered" not in spike and "not back by the end of the log" in spike
    # The spike claims no return the NaN refutes: it has none, or the log's refutation beside it.
    for claim in ("back after", "recovered: "):
        assert claim not in spike or "but the loss is non-finite from step 51" in spike
    assert check(diagnosis, text) == []


def test_the_check_finds_a_recovery_the_log_refutes(tmp_path: Path) -> None:
    """A finding that says the loss came back (as a spike detector once took the HF Trainer's
    0.0 for a NaN loss) where the log shows it non-finite to the end: the report that says "the
    run recovered" is caught, the one that shows the log's refutation beside it is not."""
    diagnosis = diagnose(str(_hf_log(tmp_path)))
    segment, spike = diagnosis.findings[0]
    back = dataclasses.replace(spike, evidence={**spike.evidence, "recovery_steps": 1.0})
    diagnosis.findings[0] = Located(segment, back)
    text = render_text(diagnosis)
    assert "but the loss is non-finite from step 51" in text and check(diagnosis, text) == []
    said = text.replace("not back by the end of the log", "the run recovered")
    assert check(diagnosis, said) == [
        "#1 says the run recovered; the loss is non-finite from step 51 to the end"
    ]


def test_a_bf16_megatron_run_is_not_told_to_switch_to_bf16() -> None:
    """#41: loss scale 1.0 on every line, noted as "no fp16 scaler (bf16 or fp32)", and still
    "or switch to bf16" in the remedies."""
    log = TESTS / "fixtures" / "real" / "logs" / "megatron_ds_issue396_gradnorm_nan_no_loss.log"
    diagnosis = diagnose(str(log))
    for text in _reports(diagnosis):
        assert "switch to bf16" not in text and "(fp32 islands)" in text
        assert check(diagnosis, text) == []
    said = render_text(diagnosis).replace("(fp32 islands)", "(fp32 islands), or switch to bf16")
    assert check(diagnosis, said)


def test_one_record_is_one_record(tmp_path: Path) -> None:
    """#41: "1 records", "1 depth groups"."""
    log = tmp_path / "one.log"
    log.write_text("step 1 loss 2.0\n")
    text = render_text(diagnose(str(log)))
    assert text.endswith("no instabilities found in 1 record") and "1 records" not in text
    assert RunHeader("32-true", "cpu", groups=("embed",)).describe().endswith(", 1 depth group")
