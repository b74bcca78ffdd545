"""The tensor checks: exact norms on the CPU's float32 fast path, the fast weights' test."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stabilizer.live.tensors import all_finite, count_nonfinite, count_suspect, l2_norms

CPU = torch.device("cpu")


def test_l2_norms_on_the_cpu_are_exact_where_float32_squares_overflow() -> None:
    tensors = [
        torch.full((4,), 1e20),  # squares beyond float32: taken again in float64
        torch.tensor([3.0, 4.0]),
        torch.tensor([1.0, math.nan]),
        torch.tensor([math.inf]),
        torch.full((2,), 1e38, dtype=torch.bfloat16),
        torch.tensor([3.0, 4.0], dtype=torch.float16),
    ]
    norms = l2_norms(tensors, CPU)
    assert norms.dtype == torch.float64
    assert norms[0].item() == pytest.approx(2e20, rel=1e-6)
    assert norms[1].item() == 5.0
    assert math.isnan(norms[2].item()) and math.isinf(norms[3].item())
    assert math.isfinite(norms[4].item()) and norms[5].item() == 5.0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 6000), st.sampled_from([0.0, 1e-3, 1.0, 1e19, 1e25, math.nan, -math.inf])
        ),
        min_size=1,
        max_size=12,
    )
)
def test_count_suspect_is_zero_exactly_when_every_value_is_finite_and_small(
    specs: list[tuple[int, float]],
) -> None:
    # Small tensors are flattened into one, big ones checked one by one: a bad value in
    # either is seen, and a tensor of finite values never makes the count exact-bad.
    tensors = [torch.full((n,), v) for n, v in specs]
    tensors.append(torch.ones(3, dtype=torch.int64))  # integers cannot be non-finite
    exact = float(count_nonfinite(tensors, CPU))
    assert exact == sum(1 for _, v in specs if not math.isfinite(v))
    assert (exact == 0) == all_finite(tensors)
    suspect = float(count_suspect(tensors, CPU))
    if exact > 0:
        assert suspect > 0
    if all(math.isfinite(v) and abs(v) <= 1e3 for _, v in specs):
        assert suspect == 0


def test_l2_norms_of_nothing_and_of_empty_tensors() -> None:
    assert l2_norms([], CPU).shape == (0,)
    norms = l2_norms([torch.zeros(0), torch.tensor([3.0, 4.0])], CPU)
    assert norms.tolist() == [0.0, 5.0]


def test_count_suspect_of_nothing_is_zero_on_the_device_asked() -> None:
    assert float(count_suspect([], CPU)) == 0.0
    assert float(count_suspect([torch.ones(2, dtype=torch.int32)], CPU)) == 0.0
    assert count_suspect([], CPU).device == CPU
