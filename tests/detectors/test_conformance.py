"""Every registered detector honours the Detector contract."""

from __future__ import annotations

import json
import pickle
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stabilizer.core.detectors import DETECTORS, Detector, default_detectors, make_detector
from stabilizer.core.kinds import KINDS, kind_of
from stabilizer.core.records import REMEDIES, Finding, StepRecord

from .streams import eventful, feed, healthy

NAMES = sorted(DETECTORS)
EVENTFUL = eventful()
# `Diverged` judges only how a stream begins: its eventful stream begins already broken.
BROKEN = [StepRecord(r.step, {**r.values, "grad_norm": 1e9}) for r in EVENTFUL[:5]] + EVENTFUL[5:]
STREAM = {name: BROKEN if name == "diverged" else EVENTFUL for name in NAMES}
EXPECTED = {name: feed(DETECTORS[name](), STREAM[name]) for name in NAMES}
HEALTHY = healthy()

KEYS = [
    "loss",
    "grad_norm",
    "grad_norm/embed",
    *[f"grad_norm/block_{i:02d}" for i in range(5)],
    "grad_norm/head",
    "update_ratio/block_00",
    "nonfinite_grads",
    "loss_scale",
    "skipped",
    "clipped",
    "clip_val",
    "lr",
    "act_absmax/blocks.0.mlp",
]
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
# Mostly ordinary values, so that detectors get past warm-up; any float may appear.
VALUES = st.one_of(FLOATS, st.floats(0.5, 4.0), st.sampled_from([0.0, 1.0, 65536.0, 1e30]))
STREAMS = st.lists(
    st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=len(KEYS)), max_size=80
).map(lambda rows: [StepRecord(step, values) for step, values in enumerate(rows)])


def _restored(detector: Detector, name: str) -> Detector:
    """A fresh detector loaded with ``detector``'s state after a strict-JSON round trip."""
    state = json.loads(json.dumps(detector.state_dict(), allow_nan=False))
    fresh = DETECTORS[name]()
    fresh.load_state_dict(state)
    return fresh


def _split_run(name: str, stream: list[StepRecord], cut: int, via: str) -> list[Finding]:
    detector: Detector = DETECTORS[name]()
    found: list[Finding] = []
    for record in stream[:cut]:
        found += detector.update(record)
    detector = _restored(detector, name) if via == "state" else pickle.loads(pickle.dumps(detector))
    return found + feed(detector, stream[cut:])


@pytest.mark.parametrize("name", NAMES)
def test_defaults_construct_and_name_matches(name: str) -> None:
    detector = DETECTORS[name]()
    assert detector.name == name
    assert isinstance(detector.requires, tuple) and detector.requires
    assert all(isinstance(key, str) and key for key in detector.requires)


@pytest.mark.parametrize("name", NAMES)
def test_fires_on_the_eventful_stream_with_known_kinds_and_remedies(name: str) -> None:
    found = EXPECTED[name]
    assert found
    for finding in found:
        assert finding.kind in KINDS
        assert kind_of(finding.kind).detector == name  # its row names the detector that emits it
        assert set(finding.remedies) <= set(REMEDIES)
        assert "\n" not in finding.message
        assert Finding.from_dict(json.loads(finding.to_json())) == finding


@pytest.mark.parametrize("name", NAMES)
def test_silent_on_a_healthy_run(name: str) -> None:
    assert feed(DETECTORS[name](), HEALTHY) == []


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_defaults_silent_on_healthy_runs(seed: int) -> None:
    stream = healthy(seed=seed)
    assert [f for d in default_detectors() for f in feed(d, stream)] == []


@pytest.mark.parametrize("via", ["state", "pickle"])
@pytest.mark.parametrize("cut", [0, 1, 202, 377, 452, 505, 700])
@pytest.mark.parametrize("name", NAMES)
def test_restore_mid_stream_continues_identically(name: str, cut: int, via: str) -> None:
    assert _split_run(name, STREAM[name], cut, via) == EXPECTED[name]


@pytest.mark.parametrize("name", NAMES)
def test_record_without_its_signals_is_a_no_op(name: str) -> None:
    detector = DETECTORS[name]()
    for record in EVENTFUL[:260]:
        detector.update(record)
    before = json.dumps(detector.state_dict(), sort_keys=True)
    assert detector.update(StepRecord(260, {})) == []
    assert detector.update(StepRecord(261, {"unrelated": float("nan")})) == []
    assert json.dumps(detector.state_dict(), sort_keys=True) == before


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=STREAMS, data=st.data())
def test_any_float_stream_never_raises_and_state_round_trips(
    name: str, stream: list[StepRecord], data: Any
) -> None:
    expected = feed(DETECTORS[name](), stream)
    cut = data.draw(st.integers(0, len(stream)), label="cut")
    assert _split_run(name, stream, cut, "state") == expected


def test_default_detectors_are_one_of_each() -> None:
    assert [d.name for d in default_detectors()] == list(DETECTORS)


def test_make_detector_passes_arguments() -> None:
    detector = make_detector("loss_spike", window=80, min_history=40)
    assert detector.name == "loss_spike"


def test_make_detector_unknown_name_lists_the_valid_ones() -> None:
    valid = ", ".join(DETECTORS)
    with pytest.raises(ValueError, match=f"`name` must be one of {valid}, got 'spike'"):
        make_detector("spike")
