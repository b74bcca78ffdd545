"""OverflowRisk on sparse activation-absmax samples."""

from __future__ import annotations

import math

import pytest

from stabilizer.core.detectors import OverflowRisk
from stabilizer.core.detectors.overflow_risk import FP16_MAX
from stabilizer.core.records import Severity, StepRecord
from stabilizer.core.run import RunHeader

from .streams import feed

MLP, ATTN = "act_absmax/blocks.1.mlp", "act_absmax/blocks.1.attn"


def _sampled(key: str, values: list[float], every: int = 25) -> list[StepRecord]:
    """Samples every ``every`` steps, with loss-only records in between."""
    stream = []
    for i, value in enumerate(values):
        stream += [StepRecord(i * every + j, {"loss": 2.0}) for j in range(1, every)]
        stream.append(StepRecord((i + 1) * every, {key: value}))
    return stream


def test_value_above_a_quarter_of_fp16_max_is_reported_once_with_its_module() -> None:
    found = feed(OverflowRisk(), _sampled(MLP, [100.0, 200.0, 20_000.0, 30_000.0, 25_000.0]))
    [finding] = found
    assert (finding.kind, finding.severity) == ("overflow_risk", Severity.WARNING)
    assert (finding.step, finding.end_step) == (75, 75)
    assert finding.location == ("blocks.1.mlp",)
    assert finding.evidence["absmax"] == 20_000.0
    assert finding.evidence["limit"] == 0.25 * FP16_MAX
    assert "blocks.1.mlp" in finding.message and "31% of the fp16 max" in finding.message
    assert finding.remedies == ("upcast_to_fp32",)


def test_geometric_growth_is_reported_before_the_limit() -> None:
    [finding] = feed(OverflowRisk(), _sampled(MLP, [300.0, 700.0, 1500.0, 3100.0, 6500.0]))
    assert (finding.step, finding.evidence["absmax"]) == (100, 3100.0)
    assert finding.evidence["growth"] == pytest.approx(3100 / 1500)
    assert "growing 2.1x per sample" in finding.message


@pytest.mark.parametrize(
    "values",
    [
        [50.0, 100.0, 200.0, 400.0, 800.0],  # doubling, but small
        [3000.0, 5000.0, 9000.0, 12_000.0],  # growing, but slower than 2x
        [16_000.0] * 40,  # large, but under the limit and flat
        [1e-3, 0.0, 1e3, 2e3, 4e3],  # zero breaks the growth chain
    ],
    ids=["small-doubling", "slow-growth", "flat-below-limit", "through-zero"],
)
def test_silent_below_the_rules(values: list[float]) -> None:
    assert feed(OverflowRisk(), _sampled(MLP, values)) == []


def test_modules_are_tracked_separately() -> None:
    stream = [
        StepRecord(0, {MLP: 20_000.0, ATTN: 10.0}),
        StepRecord(1, {MLP: 30_000.0, ATTN: 40_000.0}),
    ]
    found = feed(OverflowRisk(), stream)
    assert [(f.step, f.location) for f in found] == [
        (0, ("blocks.1.mlp",)),
        (1, ("blocks.1.attn",)),
    ]


def test_episode_ends_under_half_the_limit_and_can_recur() -> None:
    values = [20_000.0, 9_000.0, 20_000.0, 5_000.0, 20_000.0]
    found = feed(OverflowRisk(), _sampled(MLP, values, every=1))
    assert [f.step for f in found] == [1, 5]


def test_infinite_absmax_has_overflowed_and_nan_is_skipped() -> None:
    detector = OverflowRisk()
    assert detector.update(StepRecord(0, {MLP: math.nan})) == []
    [finding] = detector.update(StepRecord(1, {MLP: math.inf}))
    assert "overflowed" in finding.message
    assert detector.update(StepRecord(2, {MLP: -math.inf})) == []  # same episode


def test_records_without_its_signals_change_nothing() -> None:
    detector = OverflowRisk()
    detector.update(StepRecord(0, {MLP: 1500.0}))
    before = detector.state_dict()
    assert detector.update(StepRecord(1, {"loss": math.nan, "act_absmax": 1e9})) == []
    assert detector.state_dict() == before


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"fraction": 0.0}, r"`fraction` must be in \(0, 1\), got 0.0", id="fraction"),
        pytest.param({"growth": 0.5}, "`growth` must be >= 1.0, got 0.5", id="growth"),
        pytest.param({"samples": 0}, "`samples` must be >= 1, got 0", id="samples"),
        pytest.param({"min_level": -1.0}, "`min_level` must be >= 0.0, got -1.0", id="min_level"),
    ],
)
def test_argument_checks(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OverflowRisk(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("precision", "warns"),
    [
        ("16-mixed", True),
        ("16-true", True),
        ("fp16", True),
        ("", True),  # not known: watched
        ("32-true", False),
        ("64-true", False),
        ("bf16-mixed", False),  # bf16 has fp32's range
        ("bf16-true", False),
    ],
)
def test_the_fp16_range_is_judged_only_in_a_run_that_computes_in_fp16(
    precision: str, warns: bool
) -> None:
    """#33 item 6: an fp32 run got "reach 3.79e+08, 578152% of the fp16 max ... keep this module
    in fp32" 21 times. The run's header says its precision; only fp16 can overflow fp16."""
    detector = OverflowRisk()
    detector.set_run(RunHeader(precision=precision))
    found = feed(detector, _sampled(MLP, [100.0, 200.0, 3.79e8, 4e8]))
    assert bool(found) is warns
    assert OverflowRisk().state_dict()["fp16"] is None


def test_the_precision_rides_in_the_state() -> None:
    detector = OverflowRisk()
    detector.set_run(RunHeader(precision="32-true"))
    twin = OverflowRisk()
    twin.load_state_dict(detector.state_dict())
    assert feed(twin, _sampled(MLP, [3.79e8])) == []
