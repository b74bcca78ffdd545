"""Each scenario reproduces its failure in real training (and ``healthy`` does not).

Thresholds are on measured quantities of the run; the comments give what was measured on a 2-core
CPU, so a threshold's margin is visible.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import pytest
import torch

from conftest import TracedRun
from stabilizer.demo.scenarios import SCENARIOS, ActivationFault, Scenario, get_scenario

UNIGRAM_ENTROPY = 3.25  # nats per byte of the stdlib corpus (measured: 3.252)


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _ratio(norms: list[float]) -> float:
    return max(norms) / max(min(norms), 1e-38)


def test_healthy_loss_falls_steadily(scenario_run: Callable[[str], TracedRun]) -> None:
    loss = scenario_run("healthy").trace.loss
    assert all(math.isfinite(x) for x in loss)
    assert _median(loss[-30:]) < 0.55 * _median(loss[:5])  # measured 5.4 -> ~2.45
    # No spike: after the first steps, no loss exceeds 1.5x the median of the 20 before it.
    worst = max(loss[i] / _median(loss[i - 20 : i]) for i in range(40, len(loss)))
    assert worst < 1.5  # measured ~1.2


def test_spike_jumps_and_recovers(scenario_run: Callable[[str], TracedRun]) -> None:
    loss = scenario_run("spike").trace.loss
    start, stop = get_scenario("spike").corrupt or (0, 0)
    before = _median(loss[start - 20 : start])
    assert max(loss[start:stop]) > 2.5 * before  # measured 2.6 -> 8.3
    after = _median(loss[stop + 20 : stop + 40])
    assert after < 1.15 * before  # back within tens of steps
    assert all(math.isfinite(x) for x in loss)


def test_diverge_jumps_and_stays_up(scenario_run: Callable[[str], TracedRun]) -> None:
    loss = scenario_run("diverge").trace.loss
    surge = (get_scenario("diverge").lr_surge or (0, 0.0))[0]
    before = _median(loss[surge - 50 : surge])
    assert max(loss[surge : surge + 20]) > 1.5 * before  # measured 2.6 -> 5.0
    assert _median(loss[-50:]) > 1.15 * before  # measured 3.2 vs 2.6: it never comes back
    healthy = scenario_run("healthy").trace.loss
    assert _median(loss[-50:]) > _median(healthy[-50:]) + 0.3


def test_surge_leaves_the_loss_up_after_the_lr_is_back(
    scenario_run: Callable[[str], TracedRun],
) -> None:
    sc = get_scenario("surge")
    assert sc.lr_surge is not None and sc.lr_surge_until is not None
    traced = scenario_run("surge")
    loss, lr = traced.trace.loss, traced.trace.lr
    start, until = sc.lr_surge[0], sc.lr_surge_until
    assert lr[until] < lr[until - 1] / 50  # the surge is over
    healthy = scenario_run("healthy").trace.loss
    # 100 steps after the LR came back the loss is still well above the healthy run's.
    assert (
        _median(loss[until + 100 : until + 130]) > _median(healthy[until + 100 : until + 130]) + 0.2
    )
    assert max(loss[start : until + 5]) > 1.3 * _median(loss[start - 50 : start])


def _first_nonfinite(xs: list[float]) -> int | None:
    return next((i for i, x in enumerate(xs) if not math.isfinite(x)), None)


def test_nan_fp16_scaler_skips_and_recovers(scenario_run: Callable[[str], TracedRun]) -> None:
    traced = scenario_run("nan")
    fault = get_scenario("nan").activation_fault
    assert fault is not None
    loss = traced.trace.loss
    assert _first_nonfinite(loss) == fault.start
    assert all(not math.isfinite(x) for x in loss[fault.start : fault.stop])
    assert all(math.isfinite(x) for x in loss[fault.stop :])
    # The scaler halved its scale on each overflowing step, then training went on.
    scale = traced.trace.loss_scale
    assert scale[fault.stop] == scale[fault.start] / 2 ** (fault.stop - fault.start)
    assert _median(loss[-20:]) < _median(loss[:5]) - 1.0
    params = traced.run.module.parameters()
    assert all(torch.isfinite(p).all() for p in params)


def test_nan_16_true_never_recovers(scenario_run: Callable[[str], TracedRun]) -> None:
    traced = scenario_run("nan-16-true")
    fault = get_scenario("nan-16-true").activation_fault
    assert fault is not None
    loss = traced.trace.loss
    assert _first_nonfinite(loss) == fault.start
    assert all(not math.isfinite(x) for x in loss[fault.start :])
    assert any(not torch.isfinite(p).all() for p in traced.run.module.parameters())


def test_post_ln_deep_starves_layers_and_stalls(scenario_run: Callable[[str], TracedRun]) -> None:
    post, pre = scenario_run("post-ln-deep").trace, scenario_run("pre-ln-deep").trace
    # Per-layer gradient norms separate by orders of magnitude within 150 steps (measured 1e12).
    assert max(_ratio(n) for n in post.block_norms[:150]) > 1e4
    # ... with the input side of the stack starved (measured: block 0 ~1e-14, block 11 ~5e-2).
    last = post.block_norms[-1]
    assert last[0] < 1e-4 * last[-1]
    # The loss stalls near the unigram entropy (measured ~3.2) ...
    assert abs(_median(post.loss[-30:]) - UNIGRAM_ENTROPY) < 0.2
    # ... while the same model pre-LN keeps its layers within ~an order of magnitude (measured:
    # median 6, 95th percentile 24, one step of 235 during a transient) and trains.
    ratios = sorted(_ratio(n) for n in pre.block_norms)
    assert ratios[int(0.95 * len(ratios))] < 100
    assert _median(pre.loss[-30:]) < _median(post.loss[-30:]) - 0.15  # measured 2.95 vs 3.22


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"precision": "fp8"}, "`precision` must be one of 32-true, bf16-mixed, fp16, 16-true"),
        ({"steps": 0}, "`steps` must be >= 1, got 0"),
    ],
    ids=["precision", "steps"],
)
def test_scenario_validation(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Scenario("x", "x", **kwargs)  # type: ignore[arg-type]


def test_unknown_scenario_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown scenario 'nope'; choose one of healthy, spike"):
        get_scenario("nope")


def test_every_scenario_is_small() -> None:
    for sc in SCENARIOS.values():
        assert sc.steps <= 300 and sc.model.n_layer <= 12
        if sc.activation_fault is not None:
            assert isinstance(sc.activation_fault, ActivationFault)
            assert sc.activation_fault.stop <= sc.steps
