"""The fast paths of the detectors and the engine against naive reference implementations.

Each reference is the plain version of a fast path: a median and MAD by sorting the window, a
spike tracker that computes sigma on every value, an EMA dict updated key by key, an engine that
tests every detector's signals on every record. Floats are compared bit for bit (``repr``).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stabilizer.core.detectors import DETECTORS, Detector, GradSpike, LossSpike
from stabilizer.core.detectors._levels import BlockLevels
from stabilizer.core.detectors._robust import Classify, RobustWindow, median
from stabilizer.core.engine import Engine
from stabilizer.core.records import Finding, StepRecord
from stabilizer.core.signals import block_index

from .streams import chaotic, eventful

# Few distinct values (ties, +-0) mixed with any finite float (overflowing deviations).
VALUES = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, 2.5, -3.0, 1e-300, 5e-324, 1e308, -1e308]),
    st.floats(allow_nan=False, allow_infinity=False),
)


def naive_stats(values: Sequence[float]) -> tuple[float, float]:
    """Median and 1.4826 x MAD of a window, by sorting it (the code before the sorted window)."""
    med = median(values)
    return med, 1.4826 * median([abs(v - med) for v in values])


class NaiveTracker:
    """`SpikeTracker` as it was: a deque window, sigma computed for every value."""

    def __init__(
        self, window: int, min_history: int, recovery_window: int, classify: Classify
    ) -> None:
        self.window: deque[float] = deque(maxlen=window)
        self.min_history, self.recovery_window = min_history, recovery_window
        self.classify = classify
        self.left, self.bar = 0, -math.inf  # never a shortcut
        self.episode: dict[str, Any] | None = None

    def observe(self, step: int, value: float) -> tuple[str, dict[str, Any]] | None:
        episode = self.episode
        if episode is None:
            if len(self.window) >= self.min_history:
                med, sigma = naive_stats(self.window)
                limit = self.classify(value, med, sigma)
                if limit is not None:
                    self.episode = {"start": step, "last": step, "peak": value, "peak_step": step}
                    self.episode.update(baseline=med, limit=limit)
                    return None
            self.window.append(value)
            return None
        if value <= episode["limit"]:
            self.episode = None
            self.window.append(value)
            return "recovered", episode
        episode["last"] = step
        if value > episode["peak"]:
            episode["peak"], episode["peak_step"] = value, step
        if step - episode["start"] <= self.recovery_window:
            return None
        self.episode = None
        self.window.clear()
        self.window.append(value)
        return "stuck", episode

    def close(self) -> dict[str, Any] | None:
        episode, self.episode = self.episode, None
        return episode


def _same(a: float, b: float) -> bool:
    return repr(a) == repr(b)


@settings(max_examples=300, deadline=None)
@given(
    size=st.integers(2, 12),
    ops=st.lists(st.one_of(VALUES, st.just("clear"), st.just("load")), max_size=60),
)
def test_window_median_and_sigma_match_sorting(size: int, ops: list[Any]) -> None:
    fast, naive = RobustWindow(size), deque[float](maxlen=size)
    for op in ops:
        if op == "clear":
            fast.clear()
            naive.clear()
        elif op == "load":
            fast.load([*fast.state(), 1.5])
            naive.append(1.5)
        else:
            fast.push(op)
            naive.append(op)
        assert fast.state() == list(naive)
        if naive:
            med, sigma = fast.stats()
            want = naive_stats(naive)
            assert _same(med, want[0]) and _same(sigma, want[1])


FLOATS = st.floats(allow_nan=False)


@settings(max_examples=500, deadline=None)
@given(
    x=FLOATS,
    med=st.floats(allow_nan=False, allow_infinity=False),
    sigma=st.one_of(st.floats(0, allow_nan=False), st.just(0.0)),
    k=st.sampled_from([0.0, 1e-9, 2.5, 6.0, math.inf]),
    floor=st.sampled_from([0.0, 1e-12, 0.05, 1.0]),
)
def test_may_spike_is_false_only_when_no_sigma_makes_a_spike(
    x: float, med: float, sigma: float, k: float, floor: float
) -> None:
    detectors: list[LossSpike | GradSpike] = [
        LossSpike(k=k, rel_floor=floor, recover_k=0.0),
        GradSpike(k=k, sigma_floor=floor),
    ]
    for detector in detectors:
        if not detector._may_spike(x, med):
            assert detector._classify(x, med, sigma) is None


@settings(max_examples=500, deadline=None)
@given(
    low=st.floats(-1e300, 1e300),
    rise=st.floats(0, 1e300) | st.sampled_from([0.0, 5e-324, 1e-9]),
    below=st.floats(0, 1e300) | st.sampled_from([0.0, 5e-324]),
    sigma=st.sampled_from([0.0, 1e-12, 0.3, 1e300, math.inf]),
    k=st.sampled_from([0.0, 1e-9, 2.5, 6.0, math.inf]),
    floor=st.sampled_from([0.0, 1e-12, 0.05, 1.0]),
    ratio=st.sampled_from([1.0, 1.5, 3.0, math.inf]),
)
def test_nothing_under_the_bar_of_a_lower_median_is_a_spike(
    low: float, rise: float, below: float, sigma: float, k: float, floor: float, ratio: float
) -> None:
    jump = min(ratio, 10.0) - 1.0
    detectors: list[LossSpike | GradSpike] = [
        LossSpike(k=k, rel_floor=floor, min_ratio=ratio, min_jump=jump, recover_k=0.0),
        GradSpike(k=k, sigma_floor=floor, min_ratio=ratio),
    ]
    med = low + rise  # the median now: at or above the bound `low`
    for detector in detectors:
        bar = detector._bar(low)
        assert bar >= low
        value = bar - below if math.isfinite(bar) else 1e308
        if value <= bar and math.isfinite(med):
            assert detector._classify(value, med, sigma) is None


def _tracker_pair(make: Any) -> tuple[Any, NaiveTracker]:
    fast = make()._tracker
    sizes = (fast.window.size, fast.min_history, fast.recovery_window)
    return fast, NaiveTracker(*sizes, fast.classify)


@settings(max_examples=150, deadline=None)
@given(
    window=st.integers(2, 16),
    data=st.data(),
    values=st.lists(
        st.floats(2.0, 3.0) | st.sampled_from([0.0, -0.0, 2.5, 2.5, 10.0, 1e9, -5.0]),
        max_size=150,
    ),
)
def test_tracker_matches_the_naive_tracker(window: int, data: Any, values: list[float]) -> None:
    history = data.draw(st.integers(2, window), label="min_history")
    for make in (
        lambda: LossSpike(window=window, min_history=history, recovery_window=7),
        lambda: GradSpike(window=window, min_history=history, recovery_window=7, min_ratio=1.2),
    ):
        fast, naive = _tracker_pair(make)
        for step, value in enumerate(values):
            assert repr(fast.observe(step, value)) == repr(naive.observe(step, value))
            assert fast.state() == {"window": list(naive.window), "episode": naive.episode}
            assert [repr(v) for v in fast.state()["window"]] == [repr(v) for v in naive.window]


def _swap_trackers(detector: Detector) -> Detector:
    tracker = getattr(detector, "_tracker", None)
    if tracker is not None:
        detector._tracker = _tracker_pair(lambda: detector)[1]  # type: ignore[attr-defined]
    return detector


def _feed(detector: Detector, stream: Sequence[StepRecord]) -> list[Finding]:
    found: list[Finding] = []
    for record in stream:
        found += detector.update(record)
    return found + detector.finish()


def _as_json(found: list[Finding]) -> list[str]:
    return [finding.to_json() for finding in found]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "make",
    [
        LossSpike,
        GradSpike,
        lambda: LossSpike(window=6, min_history=6, k=0.0, rel_floor=0.0, recover_k=0.0),
        lambda: GradSpike(window=5, min_history=2, k=1.0, sigma_floor=0.0, min_ratio=1.0),
    ],
    ids=["loss", "grad", "loss-tiny", "grad-tiny"],
)
def test_spike_detectors_match_the_naive_tracker(make: Any, seed: int) -> None:
    stream = chaotic(2000, seed)
    assert _as_json(_feed(make(), stream)) == _as_json(_feed(_swap_trackers(make()), stream))


def _naive_levels(alpha: float, stream: Sequence[StepRecord]) -> list[dict[str, float]]:
    """The EMA dict of `DepthImbalance` as it was, after each record."""
    ema: dict[str, float] = {}
    states = []
    for record in stream:
        for key, value in record.values.items():
            if key.startswith("grad_norm/block_") and math.isfinite(value) and value > 0:
                group, level = key[len("grad_norm/") :], math.log10(value)
                if group in ema:
                    ema[group] += alpha * (level - ema[group])
                elif block_index(group) is not None:
                    ema[group] = level
        states.append(dict(ema))
    return states


def _block_stream(seed: int) -> list[StepRecord]:
    rng = random.Random(seed)
    odd = [0.0, -1.0, math.nan, math.inf, 1e-320, 1e300]
    stream = []
    for step in range(300):
        blocks = rng.choice([4, 12]) if step > 100 else 4
        values = {
            f"grad_norm/block_{i:02d}": rng.choice(odd) if rng.random() < 0.02 else rng.random()
            for i in range(blocks)
            if rng.random() < 0.97
        }
        values["grad_norm/block_x"], values["loss"] = 1.0, 2.0
        items = list(values.items())
        if rng.random() < 0.1:
            rng.shuffle(items)
        stream.append(StepRecord(step, dict(items)))
    return stream


@pytest.mark.parametrize("alpha", [0.1, 1.0])
@pytest.mark.parametrize("seed", range(4))
def test_block_levels_match_the_ema_dict(seed: int, alpha: float) -> None:
    stream, levels = _block_stream(seed), BlockLevels(alpha)
    for record, want in zip(stream, _naive_levels(alpha, stream), strict=True):
        levels.update(record.values)
        got = levels.state()
        assert list(got) == list(want) and all(_same(got[g], want[g]) for g in want)
        assert levels.order == sorted(want, key=lambda g: block_index(g) or 0)


def _has_signals(requires: Sequence[str], values: Mapping[str, float]) -> bool:
    return any(
        any(name.startswith(key) for name in values) if key.endswith("/") else key in values
        for key in requires
    )


def naive_replay(detectors: list[Detector], stream: Sequence[StepRecord]) -> list[Finding]:
    """The engine's loop as it was: every detector's signals tested on every record."""

    def order(f: Finding) -> tuple[Any, ...]:
        return (f.step, -f.severity, f.kind, f.location, f.message)

    found: list[Finding] = []
    for record in stream:
        batch = [
            finding
            for detector in detectors
            if _has_signals(detector.requires, record.values)
            for finding in detector.update(record)
        ]
        found += sorted(batch, key=order)
    return found + sorted((f for d in detectors for f in d.finish()), key=order)


KEYS = ["loss", "grad_norm", "grad_norm/block_00", "loss_scale", "clipped", "act_absmax/m", "x"]


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.lists(st.sampled_from(KEYS), unique=True, max_size=len(KEYS)),
            st.floats(0.5, 4.0) | st.sampled_from([0.0, math.nan, 1e6]),
        ),
        max_size=60,
    )
)
def test_engine_routes_records_like_the_naive_loop(rows: list[tuple[list[str], float]]) -> None:
    stream = [StepRecord(i, dict.fromkeys(keys, v)) for i, (keys, v) in enumerate(rows)]
    stream = eventful(120) + [StepRecord(120 + r.step, r.values) for r in stream]
    fast = Engine().replay(stream)
    assert _as_json(fast) == _as_json(naive_replay([cls() for cls in DETECTORS.values()], stream))
