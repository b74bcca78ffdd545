"""The monitor's cost meter: parts counted exclusively, the window, the one warning, the advice.

The clock is a stand-in (`FakeClock`): the meter's arithmetic is what these tests prove; the
real runs' figures are proven in tests/test_console.py (end line and JSONL of a real fit).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from stabilizer.core.records import Finding, Severity, StepRecord
from stabilizer.core.run import Cost, RunEnd
from stabilizer.step import cost as cost_module
from stabilizer.step.cost import CAUSES, WARN_AFTER, CostMeter, over_budget_advice
from stabilizer.step.live_outputs import LoggerOutput


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(cost_module.time, "perf_counter", fake)
    return fake


def _steps(
    meter: CostMeter, clock: FakeClock, n: int, work: dict[str, float], wall: float
) -> list[Cost]:
    """`n` batches of `wall` seconds, each spending `work[part]` seconds in each part; what
    their ends warned of."""
    warned = []
    for _ in range(n):
        step = int(clock.now / wall + 0.5)
        meter.batch_start(step)
        for name, seconds in work.items():
            with meter.part(name):
                clock.now += seconds
        clock.now += wall - sum(work.values())
        over = meter.batch_end(step + 1)
        warned += [over] if over is not None else []
    return warned


def test_a_nested_part_counts_for_itself_alone(clock: FakeClock) -> None:
    meter = CostMeter()
    with meter.part("guard"):
        clock.now += 1.0
        with meter.part("replay"):
            clock.now += 5.0
        clock.now += 1.0
    assert dict(meter.seconds) == {"guard": 2.0, "replay": 5.0}


def test_the_window_leaves_the_first_batch_out(clock: FakeClock) -> None:
    meter = CostMeter(budget=None)
    assert meter.cost() is None
    meter.batch_start(0)
    with meter.part("measure"):
        clock.now += 3.0  # the preflight: one-time work
    clock.now += 1.0
    meter.batch_end(1)
    assert meter.cost() is None  # nothing measured yet
    _steps(meter, clock, 10, {"measure": 0.01, "report": 0.02}, wall=1.0)
    cost = meter.cost()
    assert cost is not None and cost.steps == 10  # from batch 2's start to the last one's end
    assert cost.ms_per_step == pytest.approx(30.0)  # the preflight's 3 s are left out
    assert cost.share == pytest.approx(0.03)
    assert [name for name, _ in cost.parts] == ["report", "measure"]  # costliest first
    assert not cost.over_budget


def test_one_warning_after_enough_steps_over_the_budget(clock: FakeClock) -> None:
    meter = CostMeter(budget=0.03)
    work = {"activations": 0.05, "measure": 0.01}
    assert _steps(meter, clock, WARN_AFTER, work, wall=1.0) == []  # WARN_AFTER - 1 in the window
    [cost] = _steps(meter, clock, 1, work, wall=1.0)
    assert cost.over_budget
    assert _steps(meter, clock, 5, work, wall=1.0) == []  # once
    advice = over_budget_advice(cost)
    assert advice.startswith("over its 3% budget: mostly sampled activation maxima (50.0 ms")
    assert advice.endswith(CAUSES["activations"][1])


def test_the_budget_is_judged_every_warn_after_steps(clock: FakeClock) -> None:
    """A run that goes over its budget later is warned at the next judgement: every
    `WARN_AFTER` steps, not at every batch's end."""
    meter = CostMeter(budget=0.03)
    assert _steps(meter, clock, WARN_AFTER + 5, {"measure": 0.01}, wall=1.0) == []
    costly = {"activations": 0.5, "measure": 0.01}  # over the budget from here on
    assert _steps(meter, clock, WARN_AFTER - 5, costly, wall=1.0) == []  # judged at 20 only
    [cost] = _steps(meter, clock, 1, costly, wall=1.0)  # 40 steps in the window: judged again
    assert cost.steps == 2 * WARN_AFTER and cost.over_budget


def test_a_run_within_its_budget_is_not_warned_about(clock: FakeClock) -> None:
    meter = CostMeter(budget=0.03)
    assert _steps(meter, clock, 50, {"measure": 0.01}, wall=1.0) == []


def test_every_cause_names_what_it_is_and_its_knob() -> None:
    # That every part a real run times has a cause is checked on a real fit (test_console).
    assert all(what and knob for what, knob in CAUSES.values())


def test_the_end_line_of_the_jsonl_is_strict_json() -> None:
    cost = Cost(9, 1.5, 0.012, 0.2, (("measure", 1.0), ("report", 0.5)), 0.03)
    end = json.loads(RunEnd(10, 1, True, cost).to_json())
    assert end == {
        "type": "end", "step": 10, "skipped": 1, "intact": True, "stopped": None,
        "cost": {"steps": 9, "ms_per_step": 1.5, "share": 0.012, "wait_ms_per_step": 0.2,
                 "parts": {"measure": 1.0, "report": 0.5}, "budget": 0.03, "warned": False},
    }  # fmt: skip
    assert cost.describe() == (
        "monitor cost 1.5 ms/step (1.2% of this run's 125 ms step; the monitor's time per step "
        "hardly grows with the model, so a short step pays a large share: 0.5% of a 300 ms step; "
        "0.2 ms of it waiting for the device)"
    )
    assert json.loads(RunEnd(3).to_json())["cost"] is None


def test_the_budget_judges_a_short_step_at_a_realistic_one() -> None:
    """#33: every CPU demo ended with a warning about the monitor's own cost (13-33% of a tiny
    model's step): the budget judges it against a step of at least REFERENCE_STEP_MS, and the
    line says once why a short step pays more."""
    tiny = Cost(50, 6.0, 0.15, budget=0.03)  # 6 ms of a 40 ms step: 2% of a 300 ms one
    assert tiny.step_ms == pytest.approx(40.0) and not tiny.over_budget
    assert "2.0% of a 300 ms step" in tiny.describe()
    costly = Cost(50, 30.0, 0.5, budget=0.03)  # 30 ms: 10% even of a 300 ms step
    assert costly.over_budget
    real = Cost(50, 12.0, 0.02, budget=0.03)  # 12 ms of a 600 ms step: its own share judges
    assert not real.over_budget and real.describe() == "monitor cost 12.0 ms/step (2.0%)"
    assert Cost(50, 24.0, 0.04, budget=0.03).over_budget


class Logged:
    """A Lightning logger's `log_metrics`, recorded."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        self.steps.append(step)


def test_the_loggers_get_lightnings_cadence_and_every_step_with_a_finding() -> None:
    logger = Logged()
    out = LoggerOutput([logger], every=5)  # type: ignore[list-item]
    nan = Finding("nonfinite_loss", 7, 7, Severity.ERROR, "loss is nan")
    for step in range(12):
        out.write(StepRecord(step, {"loss": 1.0}), [nan] if step == 7 else [])
    out.write(None, [nan])  # findings alone carry no values
    assert logger.steps == [4, 7, 9]  # as Lightning: (step + 1) % log_every_n_steps == 0


def test_an_episodes_first_and_peak_steps_are_logged_in_order() -> None:
    """#33: a spike reported when it is over was missing from the loss chart between two steps
    of the cadence; its first and peak steps are logged with it, before it, in step order."""
    logger = Logged()
    out = LoggerOutput([logger], every=10)  # type: ignore[list-item]
    spike = Finding("loss_spike", 12, 14, Severity.WARNING, "spiked", {"peak_step": 13.0})
    for step in range(30):
        out.write(StepRecord(step, {"loss": 1.0}), [spike] if step == 16 else [])
    assert logger.steps == [9, 12, 13, 16, 19, 29]
