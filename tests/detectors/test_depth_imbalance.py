"""DepthImbalance on per-block gradient norms: starved bands at one end vs healthy gradients."""

from __future__ import annotations

import math
import random
import re

import pytest

from stabilizer.core.detectors import DepthImbalance
from stabilizer.core.records import Severity, StepRecord
from stabilizer.core.signals import block_group

from .streams import feed


def _stack(norms: list[float], n: int, sigma: float = 0.3, seed: int = 0) -> list[StepRecord]:
    """``n`` records of per-block norms ``norms[i]`` times exp(N(0, sigma)), plus a loss."""
    rng = random.Random(seed)
    stream = []
    for step in range(n):
        values = {"loss": 3.0, "grad_norm": 1.0}
        for i, norm in enumerate(norms):
            values[f"grad_norm/{block_group(i, len(norms))}"] = norm * math.exp(rng.gauss(0, sigma))
        stream.append(StepRecord(step, values))
    return stream


STARVED_INPUT = [1e-3] * 6 + [1.0] * 6


def test_starved_input_band_is_one_warning_after_patience_closed_at_the_end() -> None:
    [finding, closing] = feed(DepthImbalance(), _stack(STARVED_INPUT, 300))
    assert (finding.kind, finding.severity) == ("depth_imbalance", Severity.WARNING)
    assert (finding.step, finding.end_step) == (0, 49)
    assert finding.location == tuple(f"block_{i:02d}" for i in range(6))
    assert finding.message.startswith(
        "input side: blocks 0-5 get 9e-04x to 1e-03x the gradient of the rest (norms 9e-04 to "
        "1e-03, the rest's median 1e+00) for 50 records"
    )
    assert finding.evidence["ratio"] == pytest.approx(1e3, rel=1.0)
    assert (finding.evidence["band_first"], finding.evidence["band_last"]) == (0, 5)
    assert finding.evidence["blocks"] == 12
    assert finding.remedies == ("swap_to_pre_ln", "scale_lr")
    # The band lasts to the end of the stream: the closing finding covers all of it.
    assert (closing.kind, closing.severity) == ("depth_imbalance", Severity.WARNING)
    assert (closing.step, closing.end_step) == (0, 299)
    assert closing.message == (
        "input side: blocks 0-5 get 9e-04x to 1e-03x the gradient of the rest (norms 9e-04 to "
        "1e-03, the rest's median 1e+00) from step 0 until the end of the log (300 records): "
        "switch to pre-LN and keep LR warmup"
    )
    assert (closing.location, closing.evidence) == (finding.location, finding.evidence)


def test_an_extreme_band_is_reported_after_ten_records() -> None:
    # 1e-8x the rest (deep post-LN at a high LR, #23): no blip; the swap to pre-LN must come early.
    [finding, _] = feed(DepthImbalance(), _stack([1e-8] * 6 + [1.0] * 6, 100))
    assert (finding.step, finding.end_step) == (0, 9)
    assert "for 10 records" in finding.message
    # A band 1e-3x below waits for the whole patience, and the extreme rule never delays one.
    assert feed(DepthImbalance(), _stack(STARVED_INPUT, 100))[0].end_step == 49
    assert feed(DepthImbalance(patience=3), _stack([1e-8] * 6 + [1.0] * 6, 20))[0].end_step == 2


def test_the_extreme_rule_reads_the_band_s_most_starved_blocks_on_each_record() -> None:
    # Deep post-LN (#23): blocks 0-2 get 1e-10x the gradient, 3-8 1e-3x, 9-11 the rest. The
    # 100x band (0-8) is judged by its least starved block (1e3x below); the extreme rule sees
    # blocks 0-2 a million times below the median of the others on each record.
    norms = [1e-10] * 3 + [1e-3] * 6 + [1.0] * 3
    [finding, _] = feed(DepthImbalance(), _stack(norms, 100))
    assert (finding.step, finding.end_step) == (0, 9)
    assert finding.location == tuple(f"block_{i:02d}" for i in range(9))  # the whole 100x band
    assert finding.evidence["ratio"] == pytest.approx(1e3, rel=1.0)


def test_the_extreme_rule_needs_ten_records_in_a_row() -> None:
    # Block 0's gradient drops 1e8x for nine records every 40 (a rarely used input, a zeroed
    # batch): the EMA band forms each time, but for less than `patience`, and nine raw records
    # in a row are not ten.
    stream = []
    for k in range(10):
        stream += _stack([1.0] * 12, 31, seed=2 * k)
        stream += _stack([1e-8] + [1.0] * 11, 9, seed=2 * k + 1)
    stream = [StepRecord(i, r.values) for i, r in enumerate(stream)]
    assert feed(DepthImbalance(), stream) == []
    assert feed(DepthImbalance(extreme_patience=9), stream) != []  # the stream can fire it


def test_the_extreme_count_is_in_the_state() -> None:
    stream = _stack([1e-8] * 6 + [1.0] * 6, 20)
    detector = DepthImbalance()
    for record in stream[:8]:
        assert detector.update(record) == []
    resumed = DepthImbalance()
    resumed.load_state_dict(detector.state_dict())
    assert feed(resumed, stream[8:])[0].end_step == 9  # 8 records before, 2 after the resume
    old = {k: v for k, v in detector.state_dict().items() if k != "extreme"}  # before #23
    resumed = DepthImbalance()
    resumed.load_state_dict(old)
    assert feed(resumed, stream[8:])[0].end_step == 17  # the count starts again


def test_starved_output_band() -> None:
    [finding, _] = feed(DepthImbalance(patience=10), _stack([1.0] * 8 + [1e-3] * 4, 100))
    assert finding.location == ("block_08", "block_09", "block_10", "block_11")
    assert finding.message.startswith("output side: blocks 8-11")


def test_geometric_post_ln_decay_is_caught() -> None:
    # 12 blocks, gradients shrinking 3x per block towards the input: 3^11 ~ 1.8e5 end to end.
    finding = feed(DepthImbalance(), _stack([3.0 ** (i - 11) for i in range(12)], 200))[0]
    assert finding.location[0] == "block_00"
    assert finding.message.startswith("input side")


# Block norms of the reference GPT, 12 post-LN blocks at LR 3e-3 (a 50-step warmup), step 100 of
# a run whose loss sat at the unigram entropy from step 40 on: ~0.4 decades a block, so no band
# is 100x below the median of the blocks after it, while block 0 gets 2e-5x block 11's gradient.
POST_LN_3E_3 = [1e-6, 1e-6, 2e-6, 3e-6, 5e-6, 1e-5, 3e-5, 9e-5, 3e-4, 9e-4, 4e-3, 4e-2]


def test_a_geometric_decay_is_caught_by_the_end_to_end_ratio() -> None:
    stream = _stack(POST_LN_3E_3, 300)
    [finding, _] = feed(DepthImbalance(), stream)
    assert (finding.step, finding.end_step) == (0, 9)
    assert "for 10 records" in finding.message
    # what the extreme rule read, on the record that called it: block 0 against the largest
    assert 1e-6 < finding.evidence["end_share"] <= 1e-4
    assert re.search(
        r"; block 0 at \de-0[56]x the largest block's\) for 10 records", finding.message
    )
    # the band: the blocks from the input end 100x or more below the largest
    assert finding.location == tuple(f"block_{i:02d}" for i in range(9))
    assert feed(DepthImbalance(extreme_ratio=1e12), stream) == []  # the median rule misses it


def test_an_extreme_band_began_when_its_end_first_fell_ratio_below() -> None:
    # 20 records at 1e-3x (no extreme yet, too short for the patience), then 1e-6x: the band is
    # called on the extreme rule and dated from the first 1e-3x record, where the starving began.
    stream = _stack([1.0] * 12, 30) + _stack([1e-3] + [1.0] * 11, 20, seed=1)
    stream += _stack([1e-6] + [1.0] * 11, 30, seed=2)
    stream = [StepRecord(i, r.values) for i, r in enumerate(stream)]
    [finding, _] = feed(DepthImbalance(), stream)
    assert (finding.step, finding.end_step) == (30, 59)
    assert "for 30 records" in finding.message


@pytest.mark.parametrize(
    "norms",
    [
        [10 ** (1 - i / 11) for i in range(12)],  # pre-LN: block 0 10x block 11
        [10 ** (-2 * i / 11) for i in range(12)],  # a smooth 100x from one end to the other
        [3 ** (i / 11) for i in range(12)],  # late blocks 3x larger
        [1.0] * 48,
        [1.0] * 4 + [1e-4] * 4 + [1.0] * 4,  # a middle band is not an end of the stack
        [1e-4, 1e-4, 1.0],  # too few blocks
    ],
    ids=["pre-ln-10x", "falling-100x", "rising-3x", "flat-48", "middle-band", "three-blocks"],
)
def test_silent_on_healthy_stacks(norms: list[float]) -> None:
    assert feed(DepthImbalance(), _stack(norms, 1000, sigma=0.5)) == []


def test_silent_on_heavy_noise() -> None:
    assert feed(DepthImbalance(), _stack([1.0] * 12, 1000, sigma=1.5, seed=1)) == []


def test_a_blip_shorter_than_patience_is_silent() -> None:
    stream = _stack([1.0] * 12, 100) + _stack(STARVED_INPUT, 30, seed=1)
    stream += _stack([1.0] * 12, 100, seed=2)
    stream = [StepRecord(i, r.values) for i, r in enumerate(stream)]
    assert feed(DepthImbalance(), stream) == []


def test_episode_ends_when_the_band_goes_and_can_recur() -> None:
    phases = [STARVED_INPUT, [1.0] * 12, STARVED_INPUT]
    stream = [r for k, norms in enumerate(phases) for r in _stack(norms, 100, sigma=0.1, seed=k)]
    stream = [StepRecord(i, r.values) for i, r in enumerate(stream)]
    found = feed(DepthImbalance(alpha=1.0), stream)
    assert [(f.step, f.end_step, f.severity) for f in found] == [
        (0, 49, Severity.WARNING),
        (0, 99, Severity.INFO),  # back in balance at step 100
        (200, 249, Severity.WARNING),
        (200, 299, Severity.WARNING),  # until the end of the log
    ]
    assert found[1].message == (
        "input side: blocks 0-5 back within 100x of the rest's gradient at step 100, after 100 "
        "records"
    )


def test_update_ratio_is_secondary_evidence() -> None:
    stream = _stack(STARVED_INPUT, 50)
    for record in stream:
        for i in range(12):
            record.values[f"update_ratio/block_{i:02d}"] = 1e-6 if i < 6 else 1e-3  # type: ignore[index]
    finding = feed(DepthImbalance(), stream)[0]
    assert finding.evidence["update_ratio_band"] == 1e-6
    assert finding.evidence["update_ratio_rest"] == 1e-3


def test_hundred_layers_sort_by_depth() -> None:
    finding = feed(DepthImbalance(patience=5), _stack([1e-5] * 10 + [1.0] * 90, 10))[0]
    assert finding.location == tuple(f"block_{i:03d}" for i in range(10))


@pytest.mark.parametrize(
    "bad", [math.nan, math.inf, 0.0, -1.0], ids=["nan", "inf", "zero", "negative"]
)
def test_bad_block_norms_are_skipped(bad: float) -> None:
    stream = _stack(STARVED_INPUT, 60)
    for record in stream[10:20]:
        record.values["grad_norm/block_00"] = bad  # type: ignore[index]
    finding = feed(DepthImbalance(), stream)[0]
    assert (finding.step, finding.end_step) == (0, 49)


def test_records_without_block_norms_change_nothing() -> None:
    detector = DepthImbalance()
    feed(detector, _stack(STARVED_INPUT, 10))
    before = detector.state_dict()
    values = {"grad_norm": 1.0, "grad_norm/embed": 1e-9, "grad_norm/head": 1.0}
    assert detector.update(StepRecord(10, values)) == []
    assert detector.state_dict() == before


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"ratio": 1.0}, "`ratio` must be >= 2.0, got 1.0", id="ratio"),
        pytest.param({"patience": 0}, "`patience` must be >= 1, got 0", id="patience"),
        pytest.param({"alpha": 0.0}, r"`alpha` must be in \(0, 1\], got 0.0", id="alpha"),
        pytest.param({"min_blocks": 3}, "`min_blocks` must be >= 4, got 3", id="min_blocks"),
    ],
)
def test_argument_checks(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DepthImbalance(**kwargs)  # type: ignore[arg-type]


def test_the_message_gives_the_band_as_its_evidence_does() -> None:
    """The whole band, its most starved block too: a post-LN stack's input end gets 1e-9x of
    the rest's gradient where its least starved block gets 1e-3x (#21: the message said only
    the latter while the evidence and the heatmap showed the former)."""
    norms = [1e-11, 1e-9, 1e-7, 1e-5] + [1e-2] * 8
    [finding, _] = feed(DepthImbalance(), _stack(norms, 100))
    low, high = finding.evidence["band_min"], finding.evidence["band_max"]
    rest = finding.evidence["rest_median"]
    assert f"get {low / rest:.0e}x to {high / rest:.0e}x the gradient of the rest" in (
        finding.message
    )
    assert f"norms {low:.0e} to {high:.0e}, the rest's median {rest:.0e}" in finding.message
    assert low / rest < 1e-8 < 1e-2 < high / rest * 10
