"""Engine: ordering, idle and raising detectors, state round trips."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from typing import Any, ClassVar

import pytest
from detectors.streams import (
    eventful,
)  # pytest puts tests/ on sys.path (no tests/__init__.py)

from stabilizer.core.detectors import DETECTORS, LossSpike, NonFinite
from stabilizer.core.engine import Engine
from stabilizer.core.records import Finding, Severity, StepRecord


class Scripted:
    """Emits the findings scripted for each step, and counts the records it sees."""

    name: ClassVar[str] = "scripted"
    requires: ClassVar[tuple[str, ...]] = ("loss",)

    def __init__(self, script: dict[int, list[Finding]] | None = None) -> None:
        self.script = script or {}
        self.seen: list[int] = []

    def update(self, record: StepRecord) -> list[Finding]:
        self.seen.append(record.step)
        return list(self.script.get(record.step, []))

    def finish(self) -> list[Finding]:
        return [_finding("loss_spike", 99, Severity.WARNING)]

    def state_dict(self) -> dict[str, Any]:
        return {"seen": list(self.seen)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = list(state["seen"])


class NeedsScale(Scripted):
    name: ClassVar[str] = "needs_scale"
    requires: ClassVar[tuple[str, ...]] = ("loss_scale", "act_absmax/")


class Raising(Scripted):
    name: ClassVar[str] = "raising"

    def update(self, record: StepRecord) -> list[Finding]:
        if record.step == 3:
            raise ZeroDivisionError("boom")
        return super().update(record)


class ReturnsNone(Scripted):
    name: ClassVar[str] = "returns_none"

    def update(self, record: StepRecord) -> list[Finding]:
        return None  # type: ignore[return-value]


def _finding(kind: str, step: int, severity: Severity) -> Finding:
    return Finding(kind, step, step, severity, f"{kind} at {step}")


def _losses(n: int, start: int = 0) -> list[StepRecord]:
    return [StepRecord(step, {"loss": 2.5}) for step in range(start, start + n)]


def test_findings_of_a_step_are_sorted_by_step_severity_kind() -> None:
    script = {
        5: [
            _finding("grad_spike", 5, Severity.WARNING),
            _finding("nonfinite_loss", 5, Severity.ERROR),
            _finding("loss_spike", 2, Severity.WARNING),
            _finding("divergence", 5, Severity.WARNING),
        ]
    }
    engine = Engine([Scripted(script)])
    found = engine.replay(_losses(10))
    assert [(f.step, f.kind) for f in found] == [
        (2, "loss_spike"),
        (5, "nonfinite_loss"),
        (5, "divergence"),
        (5, "grad_spike"),
        (99, "loss_spike"),  # from finish
    ]
    assert engine.findings == found


def test_order_does_not_depend_on_detector_order() -> None:
    detectors = [DETECTORS[name]() for name in DETECTORS]
    forward = Engine(detectors).replay(eventful())
    backward = Engine([DETECTORS[name]() for name in reversed(DETECTORS)]).replay(eventful())
    assert forward == backward
    assert len({f.kind for f in forward}) >= 7


def test_default_engine_runs_every_registered_detector() -> None:
    assert [d.name for d in Engine().detectors] == list(DETECTORS)


def test_duplicate_detector_names_are_refused() -> None:
    with pytest.raises(
        ValueError, match="`detectors` must have unique names, got loss_spike twice"
    ):
        Engine([LossSpike(), NonFinite(), LossSpike()])


def test_signal_grace_is_checked() -> None:
    with pytest.raises(ValueError, match="`signal_grace` must be >= 1, got 0"):
        Engine(signal_grace=0)


def test_idle_detector_is_logged_once_and_not_called(caplog: pytest.LogCaptureFixture) -> None:
    idle = NeedsScale()
    engine = Engine([Scripted(), idle], signal_grace=10)
    with caplog.at_level(logging.DEBUG, logger="stabilizer.core.engine"):
        for record in _losses(50):
            engine.observe(record)
    assert idle.seen == []
    [message] = [r.getMessage() for r in caplog.records]
    assert message == (
        "detector 'needs_scale' idle: none of its signals (loss_scale, act_absmax/) "
        "in the first 10 records"
    )
    assert caplog.records[0].levelno == logging.DEBUG  # the normal case: no console line


def test_sparse_signals_still_reach_an_idle_detector() -> None:
    idle = NeedsScale()
    engine = Engine([idle], signal_grace=10)
    engine.replay([*_losses(500), StepRecord(500, {"act_absmax/blocks.0.mlp": 1.0})])
    assert idle.seen == [500]


def test_detector_seen_early_is_never_reported_idle(caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine([NeedsScale()], signal_grace=5)
    with caplog.at_level(logging.INFO, logger="stabilizer.core.engine"):
        engine.replay([StepRecord(0, {"loss_scale": 1.0}), *_losses(50, start=1)])
    assert caplog.records == []


def test_raising_detector_is_logged_once_and_disabled(caplog: pytest.LogCaptureFixture) -> None:
    raising, healthy = Raising(), Scripted({7: [_finding("loss_spike", 7, Severity.WARNING)]})
    engine = Engine([raising, healthy])
    with caplog.at_level(logging.WARNING, logger="stabilizer.core.engine"):
        found = engine.replay(_losses(10))
    assert raising.seen == [0, 1, 2]
    assert engine.disabled == {"raising"}
    assert [(f.step, f.kind) for f in found] == [(7, "loss_spike"), (99, "loss_spike")]
    [record] = caplog.records
    assert record.getMessage() == (
        "detector 'raising' raised; it is disabled for the rest of the run"
    )
    assert record.exc_info is not None and record.exc_info[0] is ZeroDivisionError
    assert "raising" not in engine.state_dict()["detectors"]


def test_detector_returning_junk_is_disabled(caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine([ReturnsNone()])
    with caplog.at_level(logging.WARNING, logger="stabilizer.core.engine"):
        assert engine.replay(_losses(5)) == []
    assert engine.disabled == {"returns_none"}
    [record] = caplog.records
    assert "returned NoneType, not a list of Finding" in record.getMessage()


def test_nonfinite_and_missing_values_never_raise() -> None:
    engine = Engine()
    values = [math.nan, math.inf, -math.inf, 0.0, -1.0, 1e308]
    keys = ["loss", "grad_norm", "grad_norm/block_00", "loss_scale", "skipped", "act_absmax/m"]
    stream = [
        StepRecord(i, {k: v}) for i, (k, v) in enumerate((k, v) for k in keys for v in values)
    ]
    engine.replay(stream)
    assert engine.disabled == frozenset()


@pytest.fixture(scope="module")
def uninterrupted() -> Engine:
    engine = Engine(signal_grace=50)
    engine.replay(eventful())
    return engine


@pytest.mark.parametrize("cut", [0, 1, 203, 451, 502, 700])
def test_state_round_trip_mid_stream_gives_the_same_findings(
    cut: int, uninterrupted: Engine
) -> None:
    stream = eventful()
    first = Engine(signal_grace=50)
    for record in stream[:cut]:
        first.observe(record)
    state = json.loads(json.dumps(first.state_dict(), allow_nan=False))
    second = Engine(signal_grace=50)
    second.load_state_dict(state)
    for record in stream[cut:]:
        second.observe(record)
    second.finish()
    assert second.findings == uninterrupted.findings
    assert len(uninterrupted.findings) >= 9


def test_state_keeps_disabled_detectors_and_counters() -> None:
    engine = Engine([Raising(), NeedsScale()], signal_grace=3)
    for record in _losses(6):
        engine.observe(record)
    state = engine.state_dict()
    assert {k: state[k] for k in ("records", "seen", "noted", "disabled")} == {
        "records": 6,
        "seen": ["raising"],
        "noted": ["needs_scale"],
        "disabled": ["raising"],
    }
    restored = Engine([Raising(), NeedsScale()], signal_grace=3)
    restored.load_state_dict(state)
    assert restored.disabled == {"raising"}


def test_state_of_unconfigured_detectors_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    state = Engine().state_dict()
    engine = Engine([LossSpike()])
    with caplog.at_level(logging.INFO, logger="stabilizer.core.engine"):
        engine.load_state_dict(state)
    assert "ignoring saved state of detectors not configured: depth_imbalance" in caplog.text


def test_unknown_state_version_is_refused() -> None:
    with pytest.raises(ValueError, match="`state` version must be 1, got 2"):
        Engine().load_state_dict({"version": 2})


def test_detection_core_imports_neither_torch_nor_lightning() -> None:
    code = (
        "import sys, stabilizer.core.engine, stabilizer.core.groups; "
        "print(sorted(m for m in ('torch', 'lightning', 'pytorch_lightning') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _curve(values: list[float], start: int = 0) -> list[StepRecord]:
    return [StepRecord(start + i, {"loss": v, "grad_norm": 1.0}) for i, v in enumerate(values)]


# 100 steps at a 3.3 plateau, then the loss of earlier weights: 5.5 for 41 steps (a restart from
# the step-0 snapshot, as `auto`'s swap to pre-LN does; held there, not learnt down: a loss learnt
# down from a jump is a new level anyway, #39, and the test is about the baselines starting over).
_PLATEAU = [3.3 + 0.02 * math.sin(i) for i in range(100)]
_RESTARTED = [5.5 + 0.02 * math.sin(i) for i in range(41)]


def test_a_restart_starts_the_loss_baseline_over() -> None:
    unaware = Engine()
    found = unaware.replay(_curve(_PLATEAU) + _curve(_RESTARTED, 100))
    assert "divergence" in {f.kind for f in found}  # measured against the plateau it left
    engine = Engine()
    for record in _curve(_PLATEAU):
        engine.observe(record)
    engine.restart()
    found = [f for r in _curve(_RESTARTED, 100) for f in engine.observe(r)] + engine.finish()
    assert found == []


def test_a_restart_keeps_an_open_spike_open() -> None:
    engine = Engine()
    for record in _curve([*_PLATEAU, 9.0, 9.0]):
        engine.observe(record)
    engine.restart()  # the spike's episode is open: it is judged against its frozen baseline
    found = [f for r in _curve([3.3] * 5, 102) for f in engine.observe(r)]
    assert [(f.kind, f.step) for f in found] == [("loss_spike", 100)]


def test_set_run_reaches_the_detectors_that_judge_by_the_run() -> None:
    """`Engine.set_run`: `OverflowRisk` learns the precision; a detector without `set_run` is
    left alone, and one whose `set_run` raises is disabled like one whose `update` does."""
    from stabilizer.core.detectors import LossSpike, OverflowRisk
    from stabilizer.core.run import RunHeader

    class Raising(LossSpike):
        name = "raising"

        def set_run(self, run: RunHeader) -> None:
            raise RuntimeError("boom")

    engine = Engine([OverflowRisk(), LossSpike(), Raising()])
    engine.set_run(RunHeader(precision="32-true"))
    assert engine.disabled == frozenset({"raising"})
    record = StepRecord(0, {"act_absmax/blocks.0.mlp": 4e8, "loss": 2.5})
    assert engine.observe(record) == []


class Finishes(Scripted):
    """Says it is done after its `last` record (as `Diverged` does past a stream's start);
    done again when loaded from a state that says so."""

    name: ClassVar[str] = "finishes"

    def __init__(self, last: int) -> None:
        super().__init__()
        self.last, self.done = last, False

    def update(self, record: StepRecord) -> list[Finding]:
        self.done = record.step >= self.last
        return super().update(record)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": list(self.seen), "done": self.done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen, self.done = list(state["seen"]), bool(state["done"])


def test_a_detector_that_says_it_is_done_is_fed_no_more_records() -> None:
    """A quiet record asks nothing of a detector with nothing left to judge; its `finish` is
    still called, and a checkpoint of it done loads done, one of it running loads running."""
    finishes, scripted = Finishes(last=2), Scripted()
    engine = Engine([finishes, scripted])
    engine.replay(_losses(6))
    assert finishes.seen == [0, 1, 2] and scripted.seen == [0, 1, 2, 3, 4, 5]
    assert [f.step for f in engine.findings] == [99, 99]  # both finished
    again = Finishes(last=2)
    resumed = Engine([again])
    resumed.load_state_dict(engine.state_dict())
    resumed.observe(StepRecord(6, {"loss": 2.5}))
    assert again.seen == [0, 1, 2]
    running = Finishes(last=9)
    before = Engine([running])
    before.replay(_losses(2))
    later = Finishes(last=9)
    after = Engine([later])
    after.load_state_dict(before.state_dict())
    after.observe(StepRecord(2, {"loss": 2.5}))
    assert later.seen == [0, 1, 2]


def test_the_run_header_retires_and_revives_overflow_risk() -> None:
    """`OverflowRisk` is done in a run that does not compute in fp16 (the engine stops asking
    it) and judges again when a later header says fp16 (a resumed run in another precision)."""
    from stabilizer.core.detectors import OverflowRisk
    from stabilizer.core.run import RunHeader

    risk = OverflowRisk()
    engine = Engine([risk])
    engine.set_run(RunHeader(precision="32-true"))
    records = [StepRecord(s, {"act_absmax/blocks.0.mlp": 1e3 * 4**s}) for s in range(6)]
    assert [f for r in records for f in engine.observe(r)] == []
    assert engine._running == []
    engine.set_run(RunHeader(precision="16-mixed"))
    found = [f for r in records for f in engine.observe(r)]
    assert [f.kind for f in found] == ["overflow_risk"]
