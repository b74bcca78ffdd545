"""The tensor checks: exact norms on the CPU's float32 fast path, the fast weights' test, and
both in one pass (`host_norms`)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stabilizer.live.tensors import (
    all_finite,
    count_nonfinite,
    count_suspect,
    host_norms,
    l2_norms,
)

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


SHAPES = {"scalar": (), "bias": (7,), "small matrix": (3, 5), "big": (70, 70)}
VALUES = [0.0, 1e-3, 1.0, 1e25, math.nan, math.inf, -math.inf]


@settings(max_examples=80, deadline=None)
@given(
    grads=st.lists(st.sampled_from([0.5, 3.0, 1e20, math.nan, math.inf]), min_size=1, max_size=5),
    check=st.lists(
        st.tuples(
            st.sampled_from(sorted(SHAPES)),
            st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
            st.sampled_from(VALUES),
        ),
        max_size=10,
    ),
)
def test_host_norms_are_the_norms_and_the_fast_test_in_one_pass(
    grads: list[float], check: list[tuple[str, torch.dtype, float]]
) -> None:
    # Adam's step counters (0-d), biases (1-d) and small matrices are joined into one for the
    # test, big tensors tested one by one, other dtypes in calls of their own: a bad value in
    # any of them is seen, and the gradients' norms are exact whatever the checked tensors hold.
    g = [torch.full((5, 9), v) for v in grads]
    tensors = [torch.full(SHAPES[shape], v, dtype=dtype) for shape, dtype, v in check]
    tensors.append(torch.ones(3, dtype=torch.int64))  # integers cannot be non-finite
    found = host_norms(g, tensors)
    assert found is not None
    norms, suspect = found
    for value, norm, t in zip(grads, norms, g, strict=True):
        want = torch.linalg.vector_norm(t.double()).item()
        assert (math.isnan(norm) and math.isnan(want)) or norm == pytest.approx(want, rel=1e-6)
        assert math.isfinite(norm) == math.isfinite(value)  # 1e20 squared: exact, in float64
    if not all_finite(tensors):
        assert suspect
    if all(math.isfinite(v) and abs(v) <= 1e3 for _, _, v in check):
        assert not suspect
    assert norms == l2_norms(g, CPU).tolist() or any(math.isnan(n) for n in norms)


def test_host_norms_leave_what_they_cannot_take_to_the_device_path() -> None:
    assert host_norms([], []) is None
    assert host_norms([torch.ones(2), torch.ones(2, dtype=torch.float64)]) is None  # two dtypes
    norms, suspect = host_norms([torch.tensor([3.0, 4.0], dtype=torch.float64) * 1e200]) or ([], 1)
    assert norms == [pytest.approx(5e200)] and suspect is False  # fp64: scaled, never squared
