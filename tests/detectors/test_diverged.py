"""`Diverged`: a stream that begins already broken, by bounds no healthy run comes near."""

from __future__ import annotations

import math

import pytest

from stabilizer.core.detectors import Diverged
from stabilizer.core.detectors.diverged import GRAD_ALONE, GRAD_WITH_LOSS, LOSS_WITH_GRAD
from stabilizer.core.records import Finding, Severity, StepRecord

# openpi#814 (tests/fixtures/real/logs/openpi_issue814_loss_1e8_gradnorm_1e6.log), first lines
OPENPI = [(681325.8, 344671968.0), (846482.4, 436317056.0), (549847.9, 247026608.0)]
OPENPI += [(775058.4, 536607616.0), (897108.3, 267218320.0)]


def _run(pairs: list[tuple[float, float | None]], first: int = 5900) -> list[Finding]:
    detector, found = Diverged(), []
    for i, (grad, loss) in enumerate(pairs):
        values = {"grad_norm": grad} if loss is None else {"grad_norm": grad, "loss": loss}
        found += detector.update(StepRecord(first + 100 * i, values))
    return found + detector.finish()


def test_a_log_that_begins_broken() -> None:
    first, last = _run(OPENPI)
    assert (first.kind, first.step, first.end_step, first.severity) == (
        "diverged",
        5900,
        6100,
        Severity.ERROR,
    )
    assert (last.step, last.end_step, last.evidence["records"]) == (5900, 6300, 5.0)
    assert "gradient norm up to 8.97e+05 beside a loss of up to 5.37e+08" in last.message
    assert "to the end of the log" in last.message


def test_a_gradient_norm_no_run_survives_needs_no_loss() -> None:
    """grokfast#9's shape: 3.8e12 and growing from the first record, the loss 11."""
    [found] = _run([(3.8e12, 11.1), (1.2e13, 11.3), (4.4e13, 11.7)], first=1)
    assert found.step == 1 and "beside" not in found.message


@pytest.mark.parametrize(
    "pairs",
    [
        [(3e5, 4e6), (5e5, 2e6), (4e5, 3e6), (6e5, 5e6)],  # a regression: loss 1e6, healthy
        [(1.3e4, 3.06), (2.6e5, 3.11), (2.5e5, 7.71)],  # BigScience 104B's spike: relative
        [(5e5, 3e8), (6e5, 4e8)],  # two records: too few
        [(0.9, 2.5), (7e5, 4e8), (8e5, 5e8), (9e5, 4e8)],  # a healthy record first: a change
        [(math.nan, 3e8), (7e5, 4e8), (8e5, 5e8), (9e5, 4e8)],  # NaN first: NonFinite's
        [(7e5, None), (8e5, None), (9e5, None)],  # no loss beside 2e5-1e8
    ],
    ids=["regression", "spike", "two", "healthy-first", "nan-first", "no-loss"],
)
def test_silent(pairs: list[tuple[float, float | None]]) -> None:
    assert _run(pairs) == []


def test_a_stretch_that_ends_says_so() -> None:
    found = _run([*OPENPI[:4], (2.0, 1.5), (7e5, 4e8), (8e5, 5e8), (9e5, 4e8)])
    assert [(f.step, f.end_step) for f in found] == [(5900, 6100), (5900, 6200)]
    assert "in range again after step 6200" in found[1].message


def test_the_bounds_stay_far_from_healthy_runs() -> None:
    assert GRAD_WITH_LOSS >= 10 * 1.3e4  # an order above the largest healthy gradient norm known
    assert LOSS_WITH_GRAD >= 10 * 1e6  # ten times a healthy regression's loss
    assert GRAD_ALONE >= 1e4 * 1.3e4 / 2


def test_records_must_be_positive() -> None:
    with pytest.raises(ValueError, match="`records` must be >= 1, got 0"):
        Diverged(records=0)
