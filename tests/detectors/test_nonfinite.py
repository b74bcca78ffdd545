"""NonFinite on literal streams of losses and gradient norms."""

from __future__ import annotations

import math

import pytest

from stabilizer.core.detectors import NonFinite
from stabilizer.core.records import Severity, StepRecord
from stabilizer.core.run import RunHeader

from .streams import feed, records

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
def test_nonfinite_loss_is_reported_at_its_very_step(bad: float) -> None:
    detector = NonFinite()
    for record in records("loss", [2.5] * 10):
        assert detector.update(record) == []
    [finding] = detector.update(StepRecord(10, {"loss": bad, "grad_norm": NAN}))
    assert (finding.kind, finding.step, finding.end_step) == ("nonfinite_loss", 10, 10)
    assert finding.severity is Severity.ERROR
    assert finding.remedies == ("skip_step", "upcast_to_fp32", "rollback")
    assert "step 10" in finding.message


def test_one_off_nan_is_one_error_and_the_episode_ends() -> None:
    found = feed(NonFinite(), records("loss", [2.5] * 5 + [NAN] + [2.5] * 5 + [NAN, NAN] + [2.4]))
    assert [(f.kind, f.step, f.severity) for f in found] == [
        ("nonfinite_loss", 5, Severity.ERROR),
        ("nonfinite_loss", 11, Severity.ERROR),
    ]


def test_persistent_nan_is_critical_once_when_it_reaches_persistent_after() -> None:
    detector = NonFinite(persistent_after=5)
    found = [f for r in records("loss", [2.5] * 3 + [NAN] * 50) for f in detector.update(r)]
    assert [(f.severity, f.step, f.end_step) for f in found] == [
        (Severity.ERROR, 3, 3),
        (Severity.CRITICAL, 3, 7),
    ]
    assert found[1].message == (
        "NaN/Inf loss persists for 5 steps since step 3: the run is not recovering: roll back "
        "and run LayerNorm/softmax in fp32"
    )
    assert (
        found[1].seen == "NaN/Inf loss persists for 5 steps since step 3: the run is not recovering"
    )
    assert found[1].advice == "roll back and run LayerNorm/softmax in fp32"
    assert found[1].remedies == ("rollback", "upcast_to_fp32")
    # Still NaN at the end of the stream: the closing finding covers the whole episode.
    [closing] = detector.finish()
    assert (closing.kind, closing.severity, closing.step, closing.end_step) == (
        "nonfinite_loss",
        Severity.CRITICAL,
        3,
        52,
    )
    assert closing.message.startswith(
        "NaN/Inf loss persists until the end of the log (50 steps) since step 3"
    )
    assert detector.finish() == []


def test_persistent_nan_that_ends_is_closed_at_its_last_step() -> None:
    found = feed(NonFinite(persistent_after=3), records("grad_norm", [1.0] + [NAN] * 4 + [1.0]))
    assert [(f.severity, f.step, f.end_step) for f in found] == [
        (Severity.ERROR, 1, 1),
        (Severity.CRITICAL, 1, 3),
        (Severity.INFO, 1, 4),
    ]
    assert found[1].message.startswith("NaN/Inf gradients persist for 3 steps since step 1")
    assert (
        found[2].message == "gradients finite again at step 5 after 4 non-finite steps since step 1"
    )


def test_nonfinite_group_grad_names_its_groups() -> None:
    values = {"loss": 2.5, "grad_norm": INF, "grad_norm/block_00": 1.0}
    values.update({"grad_norm/block_01": NAN, "grad_norm/head": INF})
    [finding] = NonFinite().update(StepRecord(7, values))
    assert (finding.kind, finding.step) == ("nonfinite_grad", 7)
    assert finding.location == ("block_01", "head")
    assert "block_01, head" in finding.message
    assert finding.evidence["nonfinite_groups"] == 2.0


def test_nonfinite_total_grad_norm_alone() -> None:
    [finding] = NonFinite().update(StepRecord(3, {"grad_norm": NAN}))
    assert (finding.kind, finding.location) == ("nonfinite_grad", ())


def test_nonfinite_grads_count() -> None:
    [finding] = NonFinite().update(StepRecord(3, {"loss": 2.0, "nonfinite_grads": 4.0}))
    assert finding.kind == "nonfinite_grad"
    assert NonFinite().update(StepRecord(3, {"loss": 2.0, "nonfinite_grads": 0.0})) == []


def test_grad_then_loss_episode_becomes_persistent_loss() -> None:
    stream = [StepRecord(0, {"loss": 2.0, "grad_norm": INF})]
    stream += [StepRecord(i, {"loss": NAN, "grad_norm": NAN}) for i in range(1, 6)]
    found = feed(NonFinite(persistent_after=3), stream)
    assert [(f.kind, f.severity, f.step, f.end_step) for f in found] == [
        ("nonfinite_grad", Severity.ERROR, 0, 0),
        ("nonfinite_loss", Severity.CRITICAL, 0, 2),
        ("nonfinite_loss", Severity.CRITICAL, 0, 5),  # until the end of the log
    ]


def test_scaler_overflow_with_finite_loss_is_left_to_fp16_overflow() -> None:
    skipped = {"loss": 2.5, "grad_norm": INF, "loss_scale": 32768.0, "skipped": 1.0}
    assert NonFinite().update(StepRecord(0, skipped)) == []
    # Without a scaler the same gradients are a finding ...
    [finding] = NonFinite().update(StepRecord(0, {"loss": 2.5, "grad_norm": INF, "skipped": 1.0}))
    assert finding.kind == "nonfinite_grad"
    # ... and a non-finite loss is always one.
    [finding] = NonFinite().update(StepRecord(0, {**skipped, "loss": NAN}))
    assert finding.kind == "nonfinite_loss"


def test_silent_on_finite_streams() -> None:
    stream = [
        StepRecord(i, {"loss": 2.5, "grad_norm": 1e30, "grad_norm/head": 0.0}) for i in range(100)
    ]
    assert feed(NonFinite(), stream) == []


def test_records_without_its_signals_change_nothing() -> None:
    detector = NonFinite()
    detector.update(StepRecord(0, {"loss": NAN}))
    before = detector.state_dict()
    assert detector.update(StepRecord(1, {"lr": NAN, "loss_scale": NAN})) == []
    assert detector.state_dict() == before


def test_persistent_after_is_checked() -> None:
    with pytest.raises(ValueError, match="`persistent_after` must be >= 2, got 1"):
        NonFinite(persistent_after=1)


def test_a_loss_pinned_at_minus_ln_flt_min_after_a_lower_one_is_a_nan() -> None:
    """Caffe clamps log(0) at -ln(FLT_MIN) = 87.3365 (times the loss weight): the same value
    twice after a lower loss is every probability underflowed (Up-Down-Captioner#2: 184.354,
    then 1746.73 = 20 x 87.3365 at iterations 100, 200, 300)."""
    losses = [184.354, 1746.73, 1746.73, 1746.73]
    steps = [0, 100, 200, 300]
    found = feed(
        NonFinite(), [StepRecord(s, {"loss": v}) for s, v in zip(steps, losses, strict=True)]
    )
    assert [(f.kind, f.step, f.severity) for f in found] == [
        ("nonfinite_loss", 200, Severity.ERROR)
    ]
    assert "87.3365" in found[0].message and "20 x" in found[0].message


def test_a_loss_that_starts_at_minus_ln_flt_min_or_passes_it_is_no_nan() -> None:
    """From 87.3366 down (BVLC/caffe#1255's first iteration), a loss near it once, or another
    constant repeated: nothing."""
    for losses in ([87.3366, 87.3366, 8.26, 8.25], [2.0, 87.3365, 3.0], [1.0, 90.0, 90.0]):
        assert feed(NonFinite(), records("loss", losses)) == []


@pytest.mark.parametrize(("precision", "fp16"), [("16-true", True), ("32-true", False)])
def test_an_update_made_non_finite_blames_fp16_eps_only_in_fp16(precision: str, fp16: bool) -> None:
    # AdamW's eps underflows to 0 in fp16; an fp32 run's NaN update is eps=0 or a huge gradient.
    detector = NonFinite()
    detector.set_run(RunHeader(precision=precision))
    (found,) = detector.update(StepRecord(3, {"loss": 1.0, "nonfinite_update": 1.0}))
    assert found.kind == "nonfinite_update"
    assert ("fp16" in found.message) == fp16
