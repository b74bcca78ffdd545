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


def _heavy_tailed(n: int, seed: int) -> list[float]:
    """A noisy norm (±30%) with a 2-4x bump on 2% of the records: a healthy run's heavy tail."""
    rng = random.Random(seed)
    return [
        math.exp(rng.gauss(0.0, 0.3)) * (rng.uniform(2.0, 4.0) if rng.random() < 0.02 else 1.0)
        for _ in range(n)
    ]


@pytest.mark.parametrize("seed", range(4))
def test_a_noisy_norm_that_keeps_bumping_gets_at_most_one_episode(seed: int) -> None:
    """#32 class 5: 29 grad_spike warnings on a 2,000-record healthy run, most on 3-6x bumps of
    a noisy norm. A bump no larger than twice the largest of the last 2,000 records is the run's
    regime: at most one finding opens, and the others fold into it (one update at the end)."""
    found = feed(GradSpike(), records("grad_norm", _heavy_tailed(2000, seed)))
    assert len({(f.step, f.kind) for f in found}) <= 1, [f.message for f in found]


def test_repeats_of_a_reported_spike_fold_into_one_update() -> None:
    """llm.c GPT-2 124M (modded-nanogpt records/track_1_short/2024-10-13_llmc/main.log): a 5.3x
    bump at step 7435 on a norm within 5% of its median, then 7.5x at 9025 and 3.4x at 9954:
    one episode, updated once at the end with the count."""
    norms = _lognormal(3000, level=0.27, sigma=0.05)
    norms[1000], norms[2590], norms[2900] = 1.44, 2.02, 0.95
    first, update = feed(GradSpike(), records("grad_norm", norms))
    assert (first.step, update.step) == (1000, 1000)
    assert update.message.startswith(first.seen + "; 2 more like it until step 2900")
    assert update.evidence["repeats"] == 2.0


def test_a_spike_far_above_the_runs_bumps_is_reported_again() -> None:
    norms = _lognormal(3000, level=0.27, sigma=0.05)
    norms[1000], norms[2000] = 1.44, 30.0  # 5x, then 110x: a new order of magnitude
    found = feed(GradSpike(), records("grad_norm", norms))
    assert [f.step for f in found] == [1000, 2000]


def test_a_lasting_level_shift_starts_a_new_regime() -> None:
    norms = _lognormal(300) + _lognormal(500, level=20.0, seed=2) + _lognormal(50, level=20.0)
    norms[700] = 2000.0  # 100x the new level
    found = feed(GradSpike(), records("grad_norm", norms))
    assert [f.step for f in found] == [300, 700]


def test_clip_saturation_of_a_sparse_log_counts_records() -> None:
    """A log that prints every 10 steps: 100 records are 1000 steps, not "100 steps"."""
    stream = [StepRecord(10 * i, {"clipped": 1.0}) for i in range(120)]
    [finding] = feed(GradSpike(), stream)
    assert finding.seen == "100% of the last 100 records were clipped"


def _bump(losses_after: list[float]) -> list[StepRecord]:
    """100 quiet records (norm ~0.35, loss ~0.09), then the norm 12x for 40 records beside
    ``losses_after`` (40 of them), then quiet again."""
    rng = random.Random(3)
    stream = []
    for step in range(180):
        bumped = 100 <= step < 140
        norm = (4.2 if bumped else 0.35) * math.exp(rng.gauss(0.0, 0.05))
        loss = losses_after[step - 100] if bumped else (0.09 if step < 100 else losses_after[-1])
        stream.append(StepRecord(step, {"grad_norm": norm, "loss": loss}))
    return stream


def test_a_norm_bump_that_goes_with_a_new_level_of_the_loss_is_no_spike() -> None:
    """The harm benchmark's new-task (a classifier relabelled halfway): the loss 0.09 -> 7.35,
    learnt down over the next 40 steps, the gradient norm 12x while it is (issue #39)."""
    learnt = [7.35 * math.exp(-i / 15) + 0.3 for i in range(40)]
    assert [f.kind for f in feed(GradSpike(), _bump(learnt))] == []


@pytest.mark.parametrize(
    "losses",
    [[0.09] * 40, [7.7] + [0.09 + 3.0 * math.exp(-i / 2) for i in range(39)]],
    ids=["loss-unmoved", "loss-spike-that-came-back"],
)
def test_a_norm_bump_without_a_new_level_is_still_a_spike(losses: list[float]) -> None:
    [spike] = feed(GradSpike(), _bump(losses))
    assert (spike.kind, spike.step) == ("grad_spike", 100)
