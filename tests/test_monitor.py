"""``StabilityMonitor`` on the real failure scenarios: each failure found, healthy runs silent.

Every scenario is trained once per session (``scenario_run`` in conftest) with the monitor attached.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import pytest

from conftest import TracedRun
from stabilizer.callbacks.monitor import StabilityMonitor
from stabilizer.core.engine import Engine
from stabilizer.core.records import Finding, Severity, StepRecord
from stabilizer.core.run import RunHeader
from stabilizer.core.signals import GRAD_NORM, LOSS, LOSS_SCALE
from stabilizer.demo.scenarios import get_scenario
from stabilizer.replay.diagnose import LIVE_KINDS
from stabilizer.replay.readers import read_log

pytestmark = pytest.mark.xdist_group("scenarios")  # one worker trains each scenario once


def _kinds(found: list[Finding], at_least: Severity = Severity.WARNING) -> list[str]:
    return [f.kind for f in found if f.severity >= at_least]


def test_healthy_gives_no_warning(scenario_run: Callable[[str], TracedRun]) -> None:
    found = scenario_run("healthy").monitor.findings
    assert _kinds(found) == [], [f.to_dict() for f in found]


def test_pre_ln_twin_has_no_depth_imbalance(scenario_run: Callable[[str], TracedRun]) -> None:
    # LR 1e-2 (after a 50-step warmup) is rough on a 12-layer model: an isolated grad_spike is real
    # there. What must not appear is a starved band of layers, or a failure.
    found = scenario_run("pre-ln-deep").monitor.findings
    kinds = _kinds(found)
    assert not {"depth_imbalance", "divergence", "nonfinite_loss", "nonfinite_grad"} & set(kinds)


def test_spike_is_one_recovered_loss_spike(scenario_run: Callable[[str], TracedRun]) -> None:
    found = scenario_run("spike").monitor.findings
    start, stop = get_scenario("spike").corrupt or (0, 0)
    spikes = [f for f in found if f.kind == "loss_spike"]
    assert len(spikes) == 1, [f.to_dict() for f in found]
    assert start <= spikes[0].step < stop
    assert spikes[0].end_step is not None and spikes[0].end_step < stop + 50
    assert spikes[0].evidence.get("recovered") == 1.0
    assert "divergence" not in _kinds(found)


def test_diverge_is_divergence(scenario_run: Callable[[str], TracedRun]) -> None:
    found = scenario_run("diverge").monitor.findings
    surge = (get_scenario("diverge").lr_surge or (0, 0.0))[0]
    div = [f for f in found if f.kind == "divergence"]
    assert div and surge <= div[0].step < surge + 20, [f.to_dict() for f in found]


def test_nan_found_at_the_first_nan_step(scenario_run: Callable[[str], TracedRun]) -> None:
    found = scenario_run("nan").monitor.findings
    fault = get_scenario("nan").activation_fault
    assert fault is not None
    nonfinite = [f for f in found if f.kind.startswith("nonfinite")]
    assert nonfinite and min(f.step for f in nonfinite) == fault.start  # zero lag
    assert "fp16_overflow" in _kinds(found)


def test_nan_16_true_is_persistent(scenario_run: Callable[[str], TracedRun]) -> None:
    found = scenario_run("nan-16-true").monitor.findings
    fault = get_scenario("nan-16-true").activation_fault
    assert fault is not None
    assert min(f.step for f in found if f.kind.startswith("nonfinite")) == fault.start
    assert any(f.severity == Severity.CRITICAL for f in found)


def test_post_ln_deep_names_the_starved_input_side(
    scenario_run: Callable[[str], TracedRun],
) -> None:
    found = scenario_run("post-ln-deep").monitor.findings
    depth = [f for f in found if f.kind == "depth_imbalance"]
    # One episode: its finding, and the closing one with the same start at the end of the run.
    assert len({f.step for f in depth}) == 1, [f.to_dict() for f in found]
    assert "block_00" in depth[0].location and "block_11" not in depth[0].location
    assert "input" in depth[0].message
    assert "swap_to_pre_ln" in depth[0].remedies


def test_jsonl_holds_every_step_and_finding(scenario_run: Callable[[str], TracedRun]) -> None:
    traced = scenario_run("spike")
    lines = (traced.log_dir / "stability.jsonl").read_text().splitlines()
    items = [json.loads(line) for line in lines]
    steps = [StepRecord.from_dict(d) for d in items if d["type"] == "step"]
    assert [r.step for r in steps] == list(range(get_scenario("spike").steps))
    assert [
        Finding.from_dict(d) for d in items if d["type"] == "finding"
    ] == traced.monitor.findings
    # The logged loss is the loss the Trace measured, rounded to float32.
    assert all(
        math.isclose(r.values[LOSS], x, rel_tol=1e-6)
        for r, x in zip(steps, traced.trace.loss, strict=True)
    )
    assert all(GRAD_NORM in r.values and "grad_norm/block_03" in r.values for r in steps)


def test_fp16_loss_is_unscaled_and_scale_logged(scenario_run: Callable[[str], TracedRun]) -> None:
    traced = scenario_run("nan")
    lines = (traced.log_dir / "stability.jsonl").read_text().splitlines()
    steps = [StepRecord.from_dict(d) for d in map(json.loads, lines) if d["type"] == "step"]
    assert steps[0].values[LOSS_SCALE] == 65536.0
    assert 5.0 < steps[0].values[LOSS] < 6.0  # ~ln(256), not 65536x it
    assert steps[-1].values[LOSS_SCALE] < 65536.0


def test_invalid_arguments() -> None:
    policies = "protect, observe, auto"
    with pytest.raises(
        ValueError, match=f"`policy` must be one of {policies} or a policy object, got 'fix'"
    ):
        StabilityMonitor(policy="fix")
    with pytest.raises(ValueError, match="`heatmap_every` must be an int >= 0, got -1"):
        StabilityMonitor(heatmap_every=-1)


PARITY_SCENARIOS = ["healthy", "spike", "diverge", "nan", "nan-16-true", "post-ln-deep"]


def replayable(findings: list[Finding]) -> list[Finding]:
    """The findings a replay can make: all but the live monitor's own (preflight, root cause)."""
    return [f for f in findings if f.kind not in LIVE_KINDS]


def _jsonl_records(traced: TracedRun) -> list[StepRecord]:
    lines = (traced.log_dir / "stability.jsonl").read_text().splitlines()
    return [StepRecord.from_dict(d) for d in map(json.loads, lines) if d["type"] == "step"]


def _engine(traced: TracedRun) -> Engine:
    """A replay's engine, told what the run is by the header its JSONL opens with, as
    `diagnose` tells it (the live monitor told its own at fit start)."""
    lines = (traced.log_dir / "stability.jsonl").read_text().splitlines()
    engine = Engine()
    engine.set_run(RunHeader.from_dict(json.loads(lines[0])))
    return engine


@pytest.mark.parametrize("name", PARITY_SCENARIOS)
def test_parity_replay_of_jsonl(scenario_run: Callable[[str], TracedRun], name: str) -> None:
    traced = scenario_run(name)
    replayed = _engine(traced).replay(_jsonl_records(traced))
    assert replayed == replayable(traced.monitor.findings)


@pytest.mark.parametrize("name", PARITY_SCENARIOS)
def test_parity_replay_of_tensorboard(scenario_run: Callable[[str], TracedRun], name: str) -> None:
    traced = scenario_run(name)
    events = sorted(traced.log_dir.glob("events.out.tfevents.*"))
    assert events
    records = list(read_log(events[0], format="tensorboard"))
    # The event file also holds Lightning's own scalars (epoch, hp_metric, val loss): compare the
    # monitor's keys, which must come back for every step, bit for bit.
    jsonl = _jsonl_records(traced)
    keys = set().union(*(r.values for r in jsonl))
    ours = [StepRecord(r.step, {k: v for k, v in r.values.items() if k in keys}) for r in records]
    assert ours[: len(jsonl)] == jsonl
    assert _engine(traced).replay(records) == replayable(traced.monitor.findings)
