"""`decide` and `risky_arithmetic`: the guard's skip-or-not and verify-or-not, on literal values."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from stabilizer.step.guard import (
    BAD_GRADS,
    BAD_LOSS,
    BAD_LR,
    BAD_WEIGHTS,
    STEPPING_PAST,
    UNCHECKED,
    decide,
    risky_arithmetic,
)

NAN, INF = math.nan, math.inf


def step(loss: float = 2.5, grad_norm: float = 1.0, nonfinite: float = 0.0) -> dict[str, float]:
    return {"loss": loss, "grad_norm": grad_norm, "nonfinite_grads": nonfinite}


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (step(), (False, "")),
        (step(grad_norm=1e30), (False, "")),  # huge but finite: verified, not skipped
        (step(grad_norm=INF), (False, "")),  # the exact count says finite: only the sum overflowed
        (step(loss=NAN), (True, BAD_LOSS)),
        (step(loss=-INF), (True, BAD_LOSS)),
        (step(grad_norm=NAN, nonfinite=1), (True, BAD_GRADS)),
        (step(nonfinite=2), (True, BAD_GRADS)),
        ({"grad_norm": 1.0, "nonfinite_grads": 0.0}, (False, "")),  # no loss: a skipped batch
        ({}, (True, UNCHECKED)),  # not measured: nothing unchecked gets through
        ({"loss": 1.0, "grad_norm": 1.0}, (True, UNCHECKED)),
    ],
    ids=[
        "healthy", "huge", "sum-overflow", "nan-loss", "inf-loss", "nan-grads", "counted",
        "no-loss", "unmeasured", "no-count",
    ],
)  # fmt: skip
def test_decide(values: dict[str, float], expected: tuple[bool, str]) -> None:
    assert decide(values) == expected


@pytest.mark.parametrize("lr", [NAN, INF, -1e-3], ids=["nan", "inf", "negative"])
def test_a_learning_rate_the_step_cannot_use_skips_it(lr: float) -> None:
    assert decide(step(), lrs=[1e-3, lr]) == (True, BAD_LR)
    assert decide(step(), lrs=[0.0, 1e-3]) == (False, "")  # a frozen group is no fault


def test_reasons_in_order_of_worth() -> None:
    assert decide(step(loss=NAN), weights_bad=True) == (True, BAD_WEIGHTS)
    assert decide(step(), stepping_past=True) == (True, STEPPING_PAST)
    # auto's own skip, whatever the numbers: they are reported (the detectors see the NaN), not
    # counted as bad steps (`stop_after` does not cut in while auto steps past bad data)
    assert decide(step(loss=NAN), stepping_past=True) == (True, STEPPING_PAST)


def test_risky_arithmetic() -> None:
    layer = nn.Linear(2, 2)
    assert risky_arithmetic(torch.optim.AdamW(layer.parameters()), 1.0) == ""
    assert risky_arithmetic(torch.optim.AdamW(layer.parameters(), eps=0.0), 1.0) == "eps=0"
    assert risky_arithmetic(torch.optim.SGD(layer.parameters(), lr=0.1), 1e20) == "a huge gradient"
    assert risky_arithmetic(torch.optim.SGD(layer.parameters(), lr=0.1), INF) == "a huge gradient"
    half = nn.Linear(2, 2).half()
    assert risky_arithmetic(torch.optim.SGD(half.parameters(), lr=0.1), 1.0) == (
        "fp16/bf16 parameters"
    )
