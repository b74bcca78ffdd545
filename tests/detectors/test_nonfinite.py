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
    assert [(f.kind, f.step, f.end_step, f.severity) for f in found] == [
        ("nonfinite_loss", 5, 5, Severity.ERROR),
        ("nonfinite_loss", 11, 11, Severity.ERROR),
        ("nonfinite_loss", 11, 12, Severity.INFO),  # its end: first, last, how many
    ]
    assert found[2].seen == "loss non-finite at steps 11-12 (2 steps), finite again at step 13"
    assert found[2].remedies == found[1].remedies


def test_a_short_nan_stretch_says_its_first_and_last_step_and_how_many() -> None:
    # A log printing every 10 steps: NaN records at steps 30-50, finite again at 60.
    losses = {0: 2.5, 10: 2.5, 20: 2.5, 30: NAN, 40: NAN, 50: NAN, 60: 2.4}
    found = feed(NonFinite(), [StepRecord(s, {"loss": v}) for s, v in losses.items()])
    assert [(f.severity, f.step, f.end_step) for f in found] == [
        (Severity.ERROR, 30, 30),
        (Severity.INFO, 30, 50),
    ]
    assert found[1].seen == "loss non-finite at steps 30-50 (3 records), finite again at step 60"


def _fp32() -> NonFinite:
    """A `NonFinite` of a run that computes in fp32: no grad scaler, nothing to probe."""
    detector = NonFinite()
    detector.set_run(RunHeader(precision="32-true"))
    return detector


def test_nonfinite_group_grad_names_its_groups() -> None:
    values = {"loss": 2.5, "grad_norm": INF, "grad_norm/block_00": 1.0}
    values.update({"grad_norm/block_01": NAN, "grad_norm/head": INF})
    [finding] = _fp32().update(StepRecord(7, values))
    assert (finding.kind, finding.step) == ("nonfinite_grad", 7)
    assert finding.location == ("block_01", "head")
    assert "block_01, head" in finding.message
    assert finding.evidence["nonfinite_groups"] == 2.0


def test_nonfinite_total_grad_norm_alone() -> None:
    [finding] = NonFinite().update(StepRecord(3, {"grad_norm": NAN}))
    assert (finding.kind, finding.location) == ("nonfinite_grad", ())


def test_nonfinite_grads_count() -> None:
    [finding] = _fp32().update(StepRecord(3, {"loss": 2.0, "nonfinite_grads": 4.0}))
    assert finding.kind == "nonfinite_grad"
    assert _fp32().update(StepRecord(3, {"loss": 2.0, "nonfinite_grads": 0.0})) == []


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
    # Without a scaler the same gradients are a finding (held until the next record, which an
    # excerpt that ends there does not show) ...
    detector = NonFinite()
    assert detector.update(StepRecord(0, {"loss": 2.5, "grad_norm": INF, "skipped": 1.0})) == []
    [finding] = detector.finish()
    assert (finding.kind, finding.severity) == ("nonfinite_grad", Severity.ERROR)
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
    assert [(f.kind, f.step, f.end_step, f.severity) for f in found] == [
        ("nonfinite_loss", 200, 200, Severity.ERROR),
        ("nonfinite_loss", 200, 300, Severity.INFO),  # the stretch the log ends in: how long
    ]
    assert "87.3365" in found[0].message and "20 x" in found[0].message
    assert "steps 200-300 (2 records), to the end of the log" in found[1].message


def test_an_excerpt_that_begins_pinned_at_minus_ln_flt_min_is_a_nan() -> None:
    """An excerpt that begins at the floor shows no lower loss: three records running at it
    are the NaN in disguise (sphereface#103: 87.3365 at every iteration, 26400-26700)."""
    found = feed(NonFinite(), records("loss", [87.3365] * 4))
    assert [(f.kind, f.step, f.end_step, f.severity) for f in found] == [
        ("nonfinite_loss", 2, 2, Severity.ERROR),
        ("nonfinite_loss", 2, 3, Severity.INFO),
    ]


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


# Judged by consequence: a non-finite gradient norm the run steps past is a scaler's probing.


def _hf(
    losses: list[float], norms: list[float], lrs: list[float] | None = None
) -> list[StepRecord]:
    """HF Trainer records (``trainer_state.json``: no loss scale), one per logging step."""
    lrs = lrs or [2e-5] * len(losses)
    return [
        StepRecord(10 * (i + 1), {"loss": loss, "grad_norm": norm, "lr": lr})
        for i, (loss, norm, lr) in enumerate(zip(losses, norms, lrs, strict=True))
    ]


def test_an_isolated_inf_norm_the_run_steps_past_is_probing_info() -> None:
    # A fp16 fine-tune's trainer_state.json: one 'grad_norm': Infinity, the loss where it was.
    losses = [1.52, 1.50, 1.49, 1.51, 1.48, 1.50, 1.47]
    norms = [0.41, 0.39, INF, 0.43, 0.40, 0.38, 0.42]
    [finding] = feed(NonFinite(), _hf(losses, norms))
    assert (finding.kind, finding.severity, finding.step) == ("nonfinite_grad", Severity.INFO, 30)
    assert "the run stepped past it" in finding.seen and "probing" in finding.seen
    assert finding.remedies == ()


def test_an_inf_norm_at_an_amp_start_up_with_lr_0_is_probing() -> None:
    # A T5 fp16 run's first record: loss 18.22, grad_norm inf, learning_rate 0.0; then it learns.
    losses, norms = [18.2196, 6.9392, 3.0593, 3.0567], [INF, 0.7139, 0.1482, 0.1659]
    [finding] = feed(NonFinite(), _hf(losses, norms, [0.0, 6.93e-05, 1.393e-04, 2.093e-04]))
    assert (finding.severity, finding.step) == (Severity.INFO, 10)


@pytest.mark.parametrize(
    ("losses", "norms", "error_at"),
    [
        ([1.5, 1.5, 1.5, 1.5, 1.5], [0.4, INF, INF, 0.4, 0.4], 20),  # the next norm is inf too
        ([1.5, 1.5, 1.5, NAN, 1.5], [0.4, 0.4, INF, NAN, 0.4], 30),  # the next loss is NaN
        ([1.5, 1.5, 1.5, 4.8, 4.9], [0.4, 0.4, INF, 0.4, 0.4], 30),  # the loss left its band
        ([1.5] * 6, [0.4, INF, 0.4, 0.4, INF, 0.4], 50),  # another one 3 records later
    ],
    ids=["repeated", "nan-loss", "out-of-band", "again-soon"],
)
def test_a_non_finite_norm_the_run_does_not_step_past_is_an_error(
    losses: list[float], norms: list[float], error_at: int
) -> None:
    found = [f for f in feed(NonFinite(), _hf(losses, norms)) if f.severity >= Severity.ERROR]
    assert [(f.kind, f.step) for f in found][:1] == [("nonfinite_grad", error_at)]


def test_in_an_fp32_run_a_non_finite_norm_is_an_error_at_once() -> None:
    detector = _fp32()
    for record in _hf([1.5, 1.5], [0.4, 0.4]):
        assert detector.update(record) == []
    [finding] = detector.update(StepRecord(30, {"loss": 1.5, "grad_norm": INF}))
    assert (finding.severity, finding.step) == (Severity.ERROR, 30)


def test_a_held_norm_survives_a_checkpoint() -> None:
    detector = NonFinite()
    for record in _hf([1.5, 1.5, 1.5], [0.4, 0.4, INF]):
        detector.update(record)
    restored = NonFinite()
    restored.load_state_dict(detector.state_dict())
    [finding] = restored.update(StepRecord(40, {"loss": 1.5, "grad_norm": 0.4}))
    assert (finding.severity, finding.step) == (Severity.INFO, 30)


def test_a_loss_that_falls_to_exactly_0_at_once_and_stays_is_a_hidden_nan() -> None:
    """Qwen-VL#352 (fp16 on a V100): 'loss': 3.8462, then 0.0 on every record while the LR warms
    up: no loss falls to exactly 0 at once; the HF Trainer prints 0.0 for a logging window whose
    every loss was NaN/Inf."""
    found = feed(NonFinite(), records("loss", [3.8462] + [0.0] * 6, start=1))
    assert [(f.kind, f.step, f.severity) for f in found][:1] == [
        ("nonfinite_loss", 4, Severity.ERROR)
    ]
    assert "exactly 0 on 3 records running, right after 3.8462" in found[0].seen


@pytest.mark.parametrize(
    "losses",
    [[0.0] * 8, [0.8, 0.3, 0.05, 0.004, 0.0, 0.0, 0.0], [2.5, 0.0, 0.0, 2.4, 0.0, 0.0, 2.3]],
    ids=["zero-from-the-start", "learnt-down-to-0", "two-zeros"],
)
def test_losses_of_0_that_are_no_hidden_nan(losses: list[float]) -> None:
    """GRPO prints 0.0 from its first record; a loss learnt down to 0 gets there gradually;
    two zeros in a row may be two batches without a target."""
    assert feed(NonFinite(), records("loss", losses)) == []
