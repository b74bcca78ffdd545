"""`decide`: the guard's skip-or-not, a pure function of a step's numbers (literal values)."""

from __future__ import annotations

import math

import pytest

from stabilizer.callbacks.guard import BAD_GRADS, BAD_LOSS, STEPPING_PAST, UNCHECKED, decide

NAN, INF = math.nan, math.inf


def step(loss: float = 2.5, grad_norm: float = 1.0, nonfinite: float = 0.0) -> dict[str, float]:
    return {"loss": loss, "grad_norm": grad_norm, "nonfinite_grads": nonfinite}


@pytest.mark.parametrize(
    ("values", "scaled", "expected"),
    [
        (step(), False, (False, "")),
        (step(grad_norm=1e30), False, (False, "")),  # huge but finite: the detectors' business
        (step(loss=NAN), False, (True, BAD_LOSS)),
        (step(loss=-INF), False, (True, BAD_LOSS)),
        (step(grad_norm=INF, nonfinite=1), False, (True, BAD_GRADS)),
        (step(grad_norm=NAN), False, (True, BAD_GRADS)),
        (step(nonfinite=2), False, (True, BAD_GRADS)),  # counted even if the norm came out finite
        # An fp16 grad scaler skips non-finite gradients itself; a non-finite loss it would not.
        (step(grad_norm=INF, nonfinite=3), True, (False, "")),
        (step(loss=NAN, grad_norm=INF), True, (True, BAD_LOSS)),
        ({}, False, (True, UNCHECKED)),  # not measured: nothing unchecked gets through
        ({"loss": 1.0, "grad_norm": 1.0}, False, (True, UNCHECKED)),
    ],
)
def test_decide(values: dict[str, float], scaled: bool, expected: tuple[bool, str]) -> None:
    assert decide(values, scaled=scaled) == expected


def test_stepping_past_skips_good_steps_only_after_the_checks() -> None:
    assert decide(step(), stepping_past=True) == (True, STEPPING_PAST)
    assert decide(step(loss=NAN), stepping_past=True) == (True, BAD_LOSS)  # the worse reason
