"""GradSpike on literal and seeded gradient-norm streams, and clip saturation."""

from __future__ import annotations

import math
import random

import pytest

from stabilizer.core.detectors import GradSpike
from stabilizer.core.records import Severity, StepRecord

from .streams import feed, records


def _lognormal(n: int, level: float = 1.0, sigma: float = 0.2, seed: int = 0) -> list[float]:
    """Gradient norms: ``level`` times exp(N(0, sigma)) (sigma 0.2 is about ±20%)."""
    rng = random.Random(seed)
    return [level * math.exp(rng.gauss(0.0, sigma)) for _ in range(n)]


@pytest.mark.parametrize(
    "spike",
    [[50.0], [10.0, 30.0, 8.0], [5.0, 5.0]],
    ids=["50x-one-step", "30x-three-steps", "5x-two-steps"],
)
def test_spike_reported_once_with_start_peak_and_end(spike: list[float]) -> None:
    norms = _lognormal(100) + spike + _lognormal(100, seed=1)
    [finding] = feed(GradSpike(), records("grad_norm", norms))
    assert (finding.kind, finding.severity) == ("grad_spike", Severity.WARNING)
    assert (finding.step, finding.end_step) == (100, 100 + len(spike) - 1)
    assert finding.evidence["peak"] == pytest.approx(max(spike))
    assert finding.evidence["baseline"] == pytest.approx(1.0, rel=0.1)
    assert finding.evidence["ratio"] == pytest.approx(max(spike), rel=0.1)
    assert finding.evidence["steps"] == len(spike)
    assert finding.remedies == ("clip_gradients", "skip_step")


def test_lasting_level_shift_is_reported_once_and_rebaselined() -> None:
    norms = _lognormal(100) + _lognormal(500, level=20.0, seed=2)
    [finding] = feed(GradSpike(), records("grad_norm", norms))
    assert (finding.step, finding.end_step) == (100, 201)
    assert "still up after 100 steps" in finding.message


def test_open_spike_is_closed_by_finish() -> None:
    [finding] = feed(GradSpike(), records("grad_norm", [*_lognormal(60), 40.0, 40.0]))
    assert (finding.step, finding.end_step) == (60, 61)
    assert "up until the end of the log" in finding.message


@pytest.mark.parametrize(
    "norms",
    [
        [1.0] * 2000,
        _lognormal(2000, sigma=0.1, seed=3),
        _lognormal(2000, sigma=0.3, seed=4),
        [v * (0.3 + 3.0 * math.exp(-i / 100)) for i, v in enumerate(_lognormal(2000, seed=5))],
        [v * (0.5 + i / 1000) for i, v in enumerate(_lognormal(2000, seed=6))],  # slow rise
        _lognormal(5000, sigma=0.2, seed=7),
    ],
    ids=["constant", "10pct", "30pct", "falling", "rising", "long-run"],
)
def test_silent_on_healthy_norms(norms: list[float]) -> None:
    assert feed(GradSpike(), records("grad_norm", norms)) == []


@pytest.mark.parametrize(
    "bad", [math.nan, math.inf, -math.inf, 0.0, -1.0], ids=["nan", "inf", "-inf", "zero", "neg"]
)
def test_nonfinite_and_nonpositive_norms_are_skipped(bad: float) -> None:
    norms = [*_lognormal(60), bad, 40.0, bad, *_lognormal(20, seed=1)]
    [finding] = feed(GradSpike(), records("grad_norm", norms))
    assert (finding.step, finding.end_step) == (61, 61)


def test_records_without_its_signals_change_nothing() -> None:
    detector = GradSpike()
    feed(detector, records("grad_norm", _lognormal(30)))
    before = detector.state_dict()
    assert detector.update(StepRecord(31, {"loss": 2.0, "clip_val": 1.0})) == []
    assert detector.state_dict() == before


def _clip_stream(flags: list[int]) -> list[StepRecord]:
    return [StepRecord(i, {"clipped": float(f)}) for i, f in enumerate(flags)]


def test_clip_saturation_reported_once_at_onset() -> None:
    flags = [0] * 100 + [1] * 300
    [finding] = feed(GradSpike(), _clip_stream(flags))
    assert (finding.kind, finding.severity) == ("clip_saturation", Severity.WARNING)
    assert (finding.step, finding.end_step) == (51, 150)  # 51 of the last 100 clipped
    assert finding.message == "51% of the last 100 steps were clipped: lower the LR instead"
    assert finding.remedies == ("scale_lr",)


def test_clip_saturation_rearms_after_the_fraction_falls() -> None:
    flags = [1] * 150 + [0] * 100 + [1] * 150
    found = feed(GradSpike(clip_window=50), _clip_stream(flags))
    assert [f.end_step for f in found] == [49, 275]


def test_clipped_is_derived_from_clip_val() -> None:
    stream = [StepRecord(i, {"grad_norm": 2.0, "clip_val": 1.0}) for i in range(100)]
    [finding] = feed(GradSpike(), stream)
    assert finding.kind == "clip_saturation"
    assert finding.evidence["clip_val"] == 1.0


def test_silent_when_clipping_is_occasional() -> None:
    rng = random.Random(0)
    flags = [int(rng.random() < 0.1) for _ in range(2000)]  # the playbook's ~90th percentile
    assert feed(GradSpike(), _clip_stream(flags)) == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"window": 1}, "`window` must be >= 2, got 1", id="window"),
        pytest.param({"k": -1.0}, "`k` must be >= 0.0, got -1.0", id="k"),
        pytest.param({"sigma_floor": -1}, "`sigma_floor` must be >= 0.0, got -1", id="floor"),
        pytest.param({"min_ratio": 0.5}, "`min_ratio` must be >= 1.0, got 0.5", id="ratio"),
        pytest.param({"recover_k": -1}, "`recover_k` must be >= 0.0, got -1", id="recover"),
        pytest.param({"clip_window": 0}, "`clip_window` must be >= 1, got 0", id="clip_window"),
        pytest.param(
            {"clip_fraction": 1.0}, r"`clip_fraction` must be in \(0, 1\), got 1.0", id="fraction"
        ),
    ],
)
def test_argument_checks(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GradSpike(**kwargs)  # type: ignore[arg-type]


def test_three_orders_of_magnitude_after_a_single_record_is_a_spike() -> None:
    # mmdet#11708 pasted two records: grad_norm 3.46, then 31,101,415.
    found = feed(GradSpike(), records("grad_norm", [3.46, 31_101_415.6]))
    assert [(f.kind, f.step) for f in found] == [("grad_spike", 1)]
    assert "the 3.46 of the record before" in found[0].message
    assert not feed(GradSpike(), records("grad_norm", [3.46, 3000.0]))  # 867x: not on so little
    assert not feed(GradSpike(), records("grad_norm", [31_101_415.6, 3.46]))  # a fall: never


def test_a_norm_growing_geometrically_with_no_jump_is_an_explosion() -> None:
    """×1.5 a record (grokfast#9: 3.8e12 → 1.4e14 over ten records, the loss flat): no record
    jumps 10×, but six in a row each 15% or more over the one before, tenfold in all, is growth."""
    norms = [3.79e12 * 1.5**i for i in range(10)]
    [found] = feed(GradSpike(), records("grad_norm", norms))
    assert (found.kind, found.step, found.severity) == ("grad_spike", 6, Severity.WARNING)  # 7th


def test_slow_growth_that_is_not_tenfold_or_not_steady_is_no_explosion() -> None:
    """A warm-up's norm rising 10% a record, or by 20% but with a dip among the six: nothing."""
    rising = [1.0 * 1.1**i for i in range(30)]
    dipping = [1.0, 1.2, 1.44, 1.3, 1.56, 1.87, 2.25, 2.7, 3.24, 3.0, 3.6]
    for norms in (rising, dipping):
        assert feed(GradSpike(), records("grad_norm", norms)) == []
