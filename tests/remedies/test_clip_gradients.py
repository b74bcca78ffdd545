"""`clip_gradients` and `enable_gradient_clipping`."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from stabilizer.live.remedies import (
    ClipReport,
    clip_gradients,
    clipped_norm,
    enable_gradient_clipping,
)


def grads(scale: float) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))]
    params[0].grad = torch.full((3,), 3.0 * scale)
    params[1].grad = torch.zeros(4)
    params[1].grad[0] = 4.0 * scale  # total norm sqrt(3 * 3² + 4²) ≈ 6.56 × scale
    return params


def total_norm(params: list[torch.nn.Parameter]) -> float:
    return math.sqrt(sum(float(p.grad.norm()) ** 2 for p in params if p.grad is not None))


@pytest.mark.parametrize("scale", [0.01, 1.0, 100.0], ids=["below", "above", "far_above"])
def test_clip_returns_pre_clip_norm_and_caps_it(scale: float) -> None:
    params = grads(scale)
    expected = total_norm(params)
    before = [p.grad.clone() for p in params if p.grad is not None]
    pre = clip_gradients(params, max_norm=1.0)
    assert pre == pytest.approx(expected, rel=1e-6)
    after = total_norm(params)
    assert after == pytest.approx(min(expected, 1.0), rel=1e-5)
    assert after == pytest.approx(clipped_norm(pre, 1.0), rel=1e-5)
    if expected < 1.0:  # under the threshold the gradients are left exactly as they were
        assert all(torch.equal(p.grad, b) for p, b in zip(params, before, strict=True))


def test_clip_without_gradients_and_on_one_tensor() -> None:
    assert clip_gradients([torch.nn.Parameter(torch.ones(2))]) == 0.0
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    assert clip_gradients(p, max_norm=1.0) == pytest.approx(5.0)


def test_clip_nonfinite_norm_does_not_raise() -> None:
    params = grads(1.0)
    assert params[0].grad is not None
    params[0].grad[0] = math.inf
    assert math.isinf(clip_gradients(params))
    assert math.isnan(clipped_norm(math.inf, 1.0))


def test_clip_rejects_nonpositive_max_norm() -> None:
    with pytest.raises(ValueError, match="`max_norm` must be > 0, got 0"):
        clip_gradients(grads(1.0), max_norm=0)
    with pytest.raises(ValueError, match="`max_norm` must be > 0, got -1"):
        enable_gradient_clipping(SimpleNamespace(gradient_clip_val=None), max_norm=-1)


@pytest.mark.parametrize(
    ("before", "expected"),
    [
        (None, ClipReport(None, 1.0)),
        (0.0, ClipReport(0.0, 1.0)),
        (5.0, ClipReport(5.0, 1.0)),
        (0.5, ClipReport(0.5, 0.5)),
        (1.0, ClipReport(1.0, 1.0)),
    ],
    ids=["off", "zero_is_off", "looser", "tighter_kept", "same"],
)
def test_enable_gradient_clipping(before: float | None, expected: ClipReport) -> None:
    trainer = SimpleNamespace(gradient_clip_val=before)  # the attribute Lightning re-reads
    report = enable_gradient_clipping(trainer, max_norm=1.0)
    assert report == expected
    assert trainer.gradient_clip_val == expected.after
    again = enable_gradient_clipping(trainer, max_norm=1.0)
    assert not again.changed and again.after == expected.after
