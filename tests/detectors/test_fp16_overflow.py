"""Fp16Overflow on literal loss-scale streams: scaler probing is healthy, cascades are not."""

from __future__ import annotations

import math

import pytest

from stabilizer.core.detectors import Fp16Overflow
from stabilizer.core.records import Severity, StepRecord

from .streams import feed


def _run(events: list[tuple[float, int]], with_flag: bool = True) -> list[StepRecord]:
    """Records of (loss scale after the step, skipped) pairs; optionally without ``skipped``."""
    return [
        StepRecord(
            i, {"loss_scale": scale, "skipped": float(skip)} if with_flag else {"loss_scale": scale}
        )
        for i, (scale, skip) in enumerate(events)
    ]


def _healthy(
    n: int, startup_skips: int = 5, growth_interval: int = 1000
) -> list[tuple[float, int]]:
    """A torch/DeepSpeed scaler: halves from 65536 at start-up, then doubles every
    ``growth_interval`` good steps and overflows (skip, halve) right after."""
    scale, events = 65536.0, []
    for i in range(n):
        if i < startup_skips or (i > startup_skips and i % growth_interval == 1):
            scale /= 2
            events.append((scale, 1))
        else:
            if i > startup_skips and i % growth_interval == 0:
                scale *= 2
            events.append((scale, 0))
    return events


@pytest.mark.parametrize("with_flag", [True, False], ids=["skipped-logged", "scale-only"])
@pytest.mark.parametrize("startup_skips", [0, 3, 8])
def test_healthy_scaler_is_silent(with_flag: bool, startup_skips: int) -> None:
    assert feed(Fp16Overflow(), _run(_healthy(3000, startup_skips), with_flag)) == []


def test_deepspeed_hysteresis_start_up_is_silent() -> None:
    # hysteresis=2: the first overflow skips without lowering the scale.
    events = [(65536.0, 1), (32768.0, 1), (16384.0, 1), (8192.0, 1)] + [(8192.0, 0)] * 500
    assert feed(Fp16Overflow(), _run(events)) == []


def _cascade_at(start: int, n: int = 100) -> list[tuple[float, int]]:
    events = _healthy(start)
    scale = events[-1][0]
    for _ in range(n):
        scale /= 2
        events.append((scale, 1))
    return events


@pytest.mark.parametrize("with_flag", [True, False], ids=["skipped-logged", "scale-only"])
def test_consecutive_skips_are_one_error_at_the_third(with_flag: bool) -> None:
    detector = Fp16Overflow()
    found = [f for r in _run(_cascade_at(500), with_flag) for f in detector.update(r)]
    [finding] = found
    assert (finding.kind, finding.severity) == ("fp16_overflow", Severity.ERROR)
    assert (finding.step, finding.end_step) == (500, 502)
    assert finding.evidence == {"skips": 3.0, "scale_start": 2048.0, "scale_min": 256.0}
    assert finding.remedies == ("upcast_to_fp32", "skip_step")
    # The cascade goes on to the end of the stream: the closing finding has the final count.
    [closing] = detector.finish()
    assert (closing.kind, closing.severity) == ("fp16_overflow", Severity.ERROR)
    assert (closing.step, closing.end_step) == (500, 599)
    assert closing.evidence["skips"] == 100.0
    assert closing.message.startswith("fp16 overflow cascade: 100 skipped steps since step 500")
    assert closing.message.endswith(", until the end of the log")
    assert detector.finish() == []


def test_message_counts_the_cascade_not_an_earlier_isolated_skip() -> None:
    # A healthy probe (double at 1000, overflow and halve at 1001) lies in the window when a
    # cascade starts 59 records later: the finding starts at the cascade, not at the probe.
    events = [*_healthy(1060), (1024.0, 1), (512.0, 1), (256.0, 1)]
    assert events[1001] == (2048.0, 1)
    [finding] = feed(Fp16Overflow(), _run(events))
    assert (finding.step, finding.end_step) == (1060, 1062)
    assert finding.message.startswith(
        "fp16 overflow cascade: 3 skipped steps since step 1060, loss scale 2048 -> 256: "
    )
    assert finding.evidence == {"skips": 3.0, "scale_start": 2048.0, "scale_min": 256.0}


def test_a_single_skip_at_the_floor_is_one_skipped_step() -> None:
    [finding] = feed(Fp16Overflow(floor=1024.0), _run([*_healthy(300), (1024.0, 1)]))
    assert (finding.step, finding.end_step) == (300, 300)
    assert finding.message == (
        "fp16 overflow cascade: 1 skipped step at step 300, loss scale 2048 -> 1024: "
        "train in bf16 or run LayerNorm/softmax in fp32"
    )
    assert finding.evidence["skips"] == 1.0


def test_scale_falling_32x_within_the_window_is_a_cascade() -> None:
    events = _healthy(300)
    scale = events[-1][0]
    for i in range(100):
        if i % 10 == 9:
            scale /= 2
        events.append((scale, int(i % 10 == 9)))
    [finding, closing] = feed(Fp16Overflow(), _run(events))
    assert (finding.step, finding.end_step) == (309, 349)
    assert finding.evidence["scale_start"] / finding.evidence["scale_min"] == 32.0
    assert (closing.step, closing.end_step, closing.evidence["skips"]) == (309, 399, 10.0)


def test_scale_at_floor_during_start_up_is_a_cascade() -> None:
    # NaN from the first step: the scaler never finds a working scale. No calibration of a fresh
    # scale ends at 16 or below: the cascade is called there, before the floor.
    events = [(65536.0 / 2 ** (i + 1), 1) for i in range(40)]
    [finding, closing] = feed(Fp16Overflow(), _run(events))
    assert (finding.step, finding.end_step) == (0, 11)
    assert finding.evidence["scale_min"] == 16.0
    assert (closing.step, closing.end_step) == (0, 39)


def test_calibration_stops_before_16() -> None:
    """stylegan2-pytorch#100: apex halves from 16384 to 2 skip after skip, no good step: no
    calibration (from 2^32, DeepSpeed's settles at 2^16); fairseq's scaler starts at 128 and
    may settle low, so a start below 2^14 stays calibration."""
    apex = [(16384.0 / 2**i, 1) for i in range(14)]
    [finding, _] = feed(Fp16Overflow(), _run(apex))
    assert (finding.step, finding.evidence["scale_min"]) == (0, 16.0)
    deepspeed = [(2.0**32 / 2**i, 1) for i in range(17)] + [(65536.0, 0)] * 5
    assert feed(Fp16Overflow(), _run(deepspeed)) == []
    fairseq = [(128.0 / 2**i, 1) for i in range(6)] + [(2.0, 0)] * 5
    assert feed(Fp16Overflow(), _run(fairseq)) == []


def test_a_scale_that_never_moves_says_where_it_stays() -> None:
    [first, last] = feed(Fp16Overflow(), _run([(1.0, 1)] * 4))
    assert "1 skipped step at step 0, at loss scale 1:" in first.message
    assert "4 skipped steps since step 0, loss scale stuck at 1" in last.message


def test_a_new_cascade_after_a_quiet_stretch_is_a_new_episode() -> None:
    events = _cascade_at(300, n=5)
    events += [(events[-1][0], 0)] * 60
    scale = events[-1][0]
    for _ in range(4):
        scale /= 2
        events.append((scale, 1))
    found = feed(Fp16Overflow(quiet=50), _run(events))
    assert [(f.step, f.end_step, f.severity) for f in found] == [
        (300, 302, Severity.ERROR),
        (300, 304, Severity.INFO),  # closed by 50 good steps: 5 skips in all
        (365, 367, Severity.ERROR),
        (365, 368, Severity.ERROR),  # until the end of the log
    ]
    assert found[1].message == (
        "fp16 overflow cascade: 5 skipped steps since step 300, loss scale 2048 -> 64; over, "
        "the scale holds at 64 since step 305"
    )


def test_skips_inside_an_episode_do_not_report_again() -> None:
    events = _cascade_at(300, n=5) + [(1.0, 0)] * 10 + [(0.5, 1)] * 5
    found = feed(Fp16Overflow(quiet=50), _run(events))
    assert [(f.step, f.end_step) for f in found] == [(300, 302), (300, 319)]  # the 2nd: finish


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_nonfinite_scale_and_flag_are_skipped(bad: float) -> None:
    detector = Fp16Overflow()
    feed(detector, _run(_healthy(50)))
    before = detector.state_dict()
    assert detector.update(StepRecord(50, {"loss_scale": bad, "skipped": 1.0})) == []
    assert detector.update(StepRecord(51, {"loss": 2.0, "skipped": 1.0})) == []
    assert detector.state_dict() == before
    assert detector.update(StepRecord(52, {"loss_scale": 2048.0, "skipped": bad})) == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"cascade": 1}, "`cascade` must be >= 2, got 1", id="cascade"),
        pytest.param({"drop_pow": 0}, "`drop_pow` must be >= 1, got 0", id="drop_pow"),
        pytest.param({"window": 1}, "`window` must be >= 2, got 1", id="window"),
        pytest.param({"floor": -1.0}, "`floor` must be >= 0.0, got -1.0", id="floor"),
        pytest.param({"quiet": 0}, "`quiet` must be >= 1, got 0", id="quiet"),
    ],
)
def test_argument_checks(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Fp16Overflow(**kwargs)  # type: ignore[arg-type]


def _at(first: int, events: list[tuple[float, int]]) -> list[StepRecord]:
    return [
        StepRecord(first + i, {"loss_scale": s, "skipped": float(k)})
        for i, (s, k) in enumerate(events)
    ]


def test_halvings_hundreds_of_steps_in_are_a_cascade_not_calibration() -> None:
    """chinese_llama_issue534: skips at steps 378-382, 64 -> 32 -> ... -> 2, no good step of
    known scale in the excerpt: past start-up, and no fresh scaler's scale: a cascade."""
    skips = [(32.0, 1), (16.0, 1), (8.0, 1), (4.0, 1), (2.0, 1)]
    found, final = feed(Fp16Overflow(), _at(378, skips))  # at the third skip, and at the end
    assert (found.kind, found.step, found.severity) == ("fp16_overflow", 378, Severity.ERROR)
    assert "5 skipped steps since step 378" in final.message


def test_a_resumed_run_whose_scaler_starts_afresh_still_calibrates() -> None:
    """Resumed at step 5000 with a fresh scaler: 65536 halving to 2048, then good steps."""
    events = [(65536.0 / 2**k, 1) for k in range(1, 6)] + [(2048.0, 0)] * 50
    assert feed(Fp16Overflow(), _at(5000, events)) == []
