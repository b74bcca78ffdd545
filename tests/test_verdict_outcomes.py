"""Verdicts true to the run (#33 items 3, 4, 6): what ``stabilizer diagnose`` says of logs of the
shapes users met, written here as the trainers print them.

- an LR too high from the first step is a run that never learned, not "a spike, recovered";
- an HF Trainer run whose loss is hidden as 0.0 beside ``grad_norm: nan`` to the end never
  recovers, and its NaN count says records where the log prints every 10 steps;
- fp16 activation warnings only where the run computes in fp16 (the JSONL header says so);
- a glitch of a few records ten iterations apart is a spike that came back, never an ERROR
  divergence whose text says it came back.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from stabilizer.core.records import Severity
from stabilizer.replay.diagnose import diagnose
from stabilizer.report.incidents import incidents, outcome
from stabilizer.report.text import render_text


def _lr_too_high_log(path: Path) -> Path:
    """nanoGPT's console lines: the loss 3.5 at iter 0, 46 at iter 1, 15-37 for ~150 iters,
    then down to a 3.3 plateau."""
    rng = random.Random(0)
    losses = [3.5012, 46.21] + [rng.uniform(15.0, 37.0) for _ in range(148)]
    losses += [3.3 + 8.7 * 0.8**i + rng.gauss(0.0, 0.03) for i in range(50)]
    lines = [f"iter {i}: loss {loss:.4f}, time 31.05ms, mfu 4.80%" for i, loss in enumerate(losses)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_an_lr_too_high_from_the_first_step_never_learned(tmp_path: Path) -> None:
    diagnosis = diagnose(str(_lr_too_high_log(tmp_path / "train.log")))
    [incident] = incidents(diagnosis)
    assert (incident.worst.kind, incident.worst.severity, incident.start) == (
        "divergence",
        Severity.ERROR,
        1,
    )
    text = render_text(diagnosis)
    assert "never learned" in text and "most of the run was lost" in text
    assert "recovered" not in text and "loss spike" not in text
    verdict = text.splitlines()[-1]
    assert "(the run never learned): lower the learning rate" in verdict  # not a rollback


def _hf_console(path: Path, hidden_from: int, every: int = 1) -> Path:
    """HF Trainer console dicts: a falling loss, then from record ``hidden_from`` on the loss
    shown as 0.0 beside grad_norm nan (logging_nan_inf_filter hides NaN losses), to the end."""
    lines = []
    for i in range(60):
        epoch = (i + 1) * every / 600
        if i < hidden_from:
            loss, norm = f"{2.5 - 0.01 * i:.4f}", "1.21"
        else:
            loss, norm = "0.0", "nan"
        lines.append(
            f"{{'loss': {loss}, 'grad_norm': {norm}, 'learning_rate': 2e-05, 'epoch': {epoch:.2f}}}"
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_nan_hidden_as_zero_to_the_end_never_recovers(tmp_path: Path) -> None:
    diagnosis = diagnose(str(_hf_console(tmp_path / "hf.log", hidden_from=20)))
    [incident] = incidents(diagnosis)
    segment = diagnosis.segments[0]
    assert segment.nonfinite_since == 21  # the first 0.0 beside a NaN norm (records count lines)
    said = outcome(incident, segment, 1)
    assert said.startswith("never recovers")
    assert "recovered" not in render_text(diagnosis)


def test_a_hidden_nan_that_ends_is_a_recovery(tmp_path: Path) -> None:
    """A loss of 0.0 beside a finite gradient norm is a loss of 0: the run goes on finite."""
    path = _hf_console(tmp_path / "hf.log", hidden_from=20)
    lines = path.read_text().splitlines()
    lines[30:] = [
        line.replace("'loss': 0.0", "'loss': 1.9").replace("nan", "1.3") for line in lines[30:]
    ]
    path.write_text("\n".join(lines) + "\n")
    diagnosis = diagnose(str(path))
    assert diagnosis.segments[0].nonfinite_since is None


def test_a_nan_count_of_a_log_every_10_steps_says_records(tmp_path: Path) -> None:
    """trainer_state.json, logging_steps=10: 41 NaN records are 400 steps, not "41 steps"."""
    history = [
        {
            "epoch": s / 1000,
            "grad_norm": 1.2,
            "learning_rate": 2e-5,
            "loss": 2.5 - s / 1e4,
            "step": s,
        }
        for s in range(10, 200, 10)
    ]
    history += [
        {"epoch": s / 1000, "grad_norm": "NaN", "learning_rate": 2e-5, "loss": 0.0, "step": s}
        for s in range(200, 610, 10)
    ]
    text = json.dumps({"global_step": 600, "log_history": history}).replace('"NaN"', "NaN")
    path = tmp_path / "trainer_state.json"
    path.write_text(text)
    report = render_text(diagnose(str(path)))
    assert "(41 records)" in report and "41 steps" not in report


def _jsonl(path: Path, precision: str) -> Path:
    """A stability.jsonl: the run's header, 200 steps, activations sampled every 25 steps that
    grow to 3.79e8 (an LR surge in fp32 does that)."""
    lines: list[dict[str, object]] = [{"type": "run", "precision": precision, "groups": []}]
    for step in range(200):
        values: dict[str, float] = {"loss": 2.5, "grad_norm": 1.0}
        if step % 25 == 0:
            values["act_absmax/blocks.0.attn.scores"] = 100.0 * 10 ** (step / 25)
        lines.append({"type": "step", "step": step, "values": values})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.parametrize(
    ("precision", "warned"),
    [("32-true", False), ("bf16-mixed", False), ("16-mixed", True), ("", True)],
)
def test_fp16_range_warnings_only_for_a_run_in_fp16(
    tmp_path: Path, precision: str, warned: bool
) -> None:
    diagnosis = diagnose(str(_jsonl(tmp_path / "stability.jsonl", precision)))
    kinds = {item.finding.kind for item in diagnosis.findings}
    assert ("overflow_risk" in kinds) is warned


def test_a_glitch_of_a_few_records_is_a_spike_that_came_back(tmp_path: Path) -> None:
    """Megatron lines every 10 iterations: 2.77, 2.77, 2.77 ..., 7.3, 8.7, 7.7 (30 iterations),
    then 2.8 again: a loss spike, back after 30 steps, not an ERROR divergence."""
    rng = random.Random(1)
    losses = [2.77 + rng.gauss(0.0, 0.01) for _ in range(30)] + [7.34, 8.72, 7.65]
    losses += [2.78 + rng.gauss(0.0, 0.01) for _ in range(10)]
    lines = [
        f" iteration {29000 + 10 * i:8d}/  311541 | consumed samples: {10240 * i:12d} | "
        f"learning rate: 9.850E-05 | global batch size:  1024 | lm loss: {loss:.6E} | "
        "loss scale: 32768.0 | number of skipped iterations:   0 | number of nan iterations:   0 |"
        for i, loss in enumerate(losses)
    ]
    path = tmp_path / "megatron.log"
    path.write_text("\n".join(lines) + "\n")
    diagnosis = diagnose(str(path))
    [incident] = incidents(diagnosis)
    assert (incident.worst.kind, incident.worst.severity) == ("loss_spike", Severity.WARNING)
    assert "back after 30 steps" in incident.worst.seen
