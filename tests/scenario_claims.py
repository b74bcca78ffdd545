"""What each failure scenario claims, as margins measured on a traced run.

A claim is a measured quantity of the run (a loss ratio, a recovery step, a gradient-norm ratio)
against a bound. ``claims(name, curves, twins)`` lists a scenario's margins; the scenario tests
assert that each holds (``test_scenarios.py``, on the session's runs and, with ``--sweep``, over
seeds 0-4 and 1 and 2 torch threads), and ``python tests/scenario_sweep.py`` prints them, so a
margin that has grown thin is visible before it fails. ``Trace`` is the callback that measures.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import lightning.pytorch as pl
import torch

from stabilizer.demo.scenarios import get_scenario

__all__ = ["TWINS", "UNIGRAM_ENTROPY", "Curves", "Margin", "Trace", "claims"]

UNIGRAM_ENTROPY = 3.25  # nats per byte of the stdlib corpus (measured: 3.252)


class Curves(Protocol):
    """Per optimizer step: the unscaled loss, each block's gradient norm, the total gradient norm
    (every parameter, before any clipping), the loss scale, the LR; and whether every weight was
    finite at the end."""

    loss: list[float]
    block_norms: list[list[float]]
    grad_norm: list[float]
    loss_scale: list[float]
    lr: list[float]
    finite_weights: bool


@dataclass
class Trace(pl.Callback):
    """Records the quantities the failures are defined by (see ``Curves``), per optimizer step.

    A plain measuring callback, independent of the monitor under test.
    """

    loss: list[float] = field(default_factory=list)
    block_norms: list[list[float]] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    loss_scale: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    finite_weights: bool = True
    _loss: float = math.nan

    def on_before_backward(self, trainer: pl.Trainer, pl_module: Any, loss: torch.Tensor) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        scale = float(scaler.get_scale()) if scaler is not None else 1.0
        self._loss = float(loss.detach().float()) / scale  # under fp16 the loss is scaled here
        self.loss_scale.append(scale)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        norms = [
            math.sqrt(
                sum(float(p.grad.float().norm()) ** 2 for p in b.parameters() if p.grad is not None)
            )
            for b in pl_module.model.blocks
        ]
        self.block_norms.append(norms)
        grads = [p.grad.float().norm() for p in pl_module.parameters() if p.grad is not None]
        self.grad_norm.append(float(torch.stack(grads).norm()) if grads else math.nan)
        self.lr.append(float(optimizer.param_groups[0]["lr"]))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.loss.append(self._loss)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.finite_weights = all(bool(torch.isfinite(p).all()) for p in pl_module.parameters())


@dataclass(frozen=True)
class Margin:
    """One measured quantity of a run against the bound its scenario's claim sets."""

    what: str
    value: float
    op: str  # ">", "<" or "=": how the value must compare with the bound for the claim to hold
    bound: float

    @property
    def holds(self) -> bool:
        if self.op == ">":
            return self.value > self.bound
        return self.value < self.bound if self.op == "<" else self.value == self.bound

    def __str__(self) -> str:
        return f"{self.what} = {self.value:.4g} ({self.op} {self.bound:.4g})"


def _over(what: str, value: float, bound: float) -> Margin:
    return Margin(what, value, ">", bound)


def _under(what: str, value: float, bound: float) -> Margin:
    return Margin(what, value, "<", bound)


def _equal(what: str, value: float, want: float) -> Margin:
    return Margin(what, value, "=", want)


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _spread(norms: list[float]) -> float:
    """Largest over smallest per-block gradient norm."""
    return max(norms) / max(min(norms), 1e-38)


def _nonfinite(xs: list[float]) -> int:
    return sum(not math.isfinite(x) for x in xs)


def _healthy(curves: Curves, twins: Mapping[str, Curves]) -> list[Margin]:
    loss = curves.loss
    worst = max(loss[i] / _median(loss[i - 20 : i]) for i in range(40, len(loss)))
    return [
        _equal("non-finite losses", _nonfinite(loss), 0),
        _under("loss end / start", _median(loss[-30:]) / _median(loss[:5]), 0.55),
        _under("largest loss / median of the 20 before", worst, 1.5),
    ]


def _spike(curves: Curves, twins: Mapping[str, Curves]) -> list[Margin]:
    loss = curves.loss
    start, stop = get_scenario("spike").corrupt or (0, 0)
    before = _median(loss[start - 20 : start])
    return [
        _equal("non-finite losses", _nonfinite(loss), 0),
        _over("peak / before", max(loss[start:stop]) / before, 2.5),
        _under("20-40 steps after / before", _median(loss[stop + 20 : stop + 40]) / before, 1.15),
    ]


def _finite_or_inf(xs: list[float]) -> list[float]:
    return [x if math.isfinite(x) else math.inf for x in xs]


def _spike_sgd(curves: Curves, twins: Mapping[str, Curves]) -> list[Margin]:
    sc = get_scenario("spike-sgd")
    bad = sorted(sc.corrupted())
    first, second = bad[0], bad[1]
    loss, norms = curves.loss, curves.grad_norm
    before = _median(loss[first - 20 : first])
    return [
        # Each zero-filled batch is an outsized gradient (most of it in the embedding, which
        # also un-embeds: every position pushes the NUL byte's logit up): the first, in the
        # warmup where the normal norms are still ~1, and the second, on the model that
        # survived the first, near the full LR ...
        _over(
            "first bad batch's gradient norm / median of the 20 before",
            norms[first] / _median(norms[first - 20 : first]),
            3.0,
        ),
        _over(
            "second bad batch's gradient norm / median of the 20 before",
            norms[second] / _median(norms[second - 20 : second]),
            10.0,
        ),
        # ... the first of which the run survives (the LR is still warming up) ...
        _under(
            "loss 20-40 steps after the first / before",
            _median(loss[first + 20 : second]) / before,
            1.15,
        ),
        # ... and the later ones throw it off for good: the end is far above where the loss
        # stood before the first bad batch (a NaN counts as infinitely far).
        _over(
            "last 30 losses (median) / before", _median(_finite_or_inf(loss[-30:])) / before, 1.5
        ),
    ]


def _diverge(curves: Curves, twins: Mapping[str, Curves]) -> list[Margin]:
    loss = curves.loss
    surge = (get_scenario("diverge").lr_surge or (0, 0.0))[0]
    before = _median(loss[surge - 50 : surge])
    return [
        _equal("non-finite losses", _nonfinite(loss), 0),
        _over("peak / before", max(loss[surge : surge + 20]) / before, 1.5),
        # It never comes back: not one loss from 20 steps after the jump to the end comes near
        # the old level (a detector's recovery bar is ~1.15x it; its jump bar 1.5x).
        _over("lowest loss after / before", min(loss[surge + 20 :]) / before, 1.5),
    ]


def _surge(curves: Curves, twins: Mapping[str, Curves]) -> list[Margin]:
    sc = get_scenario("surge")
    start, until = (sc.lr_surge or (0, 0.0))[0], sc.lr_surge_until or 0
    loss, healthy = curves.loss, twins["healthy"].loss
    before = _median(loss[start - 50 : start])
    late = slice(until + 100, until + 130)
    return [
        _equal("non-finite losses", _nonfinite(loss), 0),
        _over("LR in the surge / after it", curves.lr[until - 1] / curves.lr[until], 50),
        _over("peak / before", max(loss[start : until + 5]) / before, 1.5),
        # The LR is back, the loss is not: not one loss after the surge comes near its old level
        # (a detector's recovery bar is ~1.15x it; its jump bar 1.5x) ...
        _over("lowest loss after / before", min(loss[until:]) / before, 1.5),
        # ... and 100 steps after the LR came back it is still far above the healthy run's.
        _over(
            "100 steps after the surge - healthy", _median(loss[late]) - _median(healthy[late]), 1.0
        ),
    ]


def _nan_window(name: str, curves: Curves) -> tuple[int, int, list[float]]:
    fault = get_scenario(name).activation_fault
    assert fault is not None
    return fault.start, fault.stop, curves.loss


def _first_nonfinite(xs: list[float]) -> float:
    return next((i for i, x in enumerate(xs) if not math.isfinite(x)), math.inf)


def _nan(curves: Curves, twins: Mapping[str, Curves]) -> list[Margin]:
    start, stop, loss = _nan_window("nan", curves)
    scale = curves.loss_scale
    return [
        _equal("first non-finite step", _first_nonfinite(loss), start),
        _equal("non-finite losses", _nonfinite(loss), stop - start),
        # The scaler halved its scale on each overflowing step, then training went on.
        _equal("scale halvings", math.log2(scale[start] / scale[stop]), stop - start),
        _over("loss drop, start to end", _median(loss[:5]) - _median(loss[-20:]), 1.0),
        _equal("weights finite at the end", curves.finite_weights, True),
    ]


def _nan_16_true(curves: Curves, twins: Mapping[str, Curves]) -> list[Margin]:
    start, _, loss = _nan_window("nan-16-true", curves)
    return [
        _equal("first non-finite step", _first_nonfinite(loss), start),
        _equal("non-finite losses", _nonfinite(loss), len(loss) - start),
        _equal("weights finite at the end", curves.finite_weights, False),
    ]


def _softmax_fp16(curves: Curves, twins: Mapping[str, Curves]) -> list[Margin]:
    # No injected fault: the attention scores grow by themselves until exp overflows fp16
    # (measured in fp32: the largest score passes 11.09 near step 37 and stays at ~20-27).
    loss = curves.loss
    first = _first_nonfinite(loss)
    return [
        _over("first non-finite step", first, 25),
        _under("first non-finite step", first, 55),
        _equal("non-finite losses", _nonfinite(loss), len(loss) - first),  # never recovers
        _equal("weights finite at the end", curves.finite_weights, False),
    ]


def _stall(curves: Curves, twins: Mapping[str, Curves]) -> list[Margin]:
    loss = curves.loss
    # At step 300, where the stall check runs, the loss is within its 10% of where it started
    # (a run that ends before step 300 shows no stall: its ratio is NaN, which breaks the claim).
    at_300 = _median(loss[296:301]) if len(loss) > 300 else math.nan
    return [
        _equal("non-finite losses", _nonfinite(loss), 0),
        _over("steps trained", len(loss), 300),
        _over("loss at step 300 / start", at_300 / _median(loss[:5]), 0.9),
    ]


def _post_ln_deep(curves: Curves, twins: Mapping[str, Curves]) -> list[Margin]:
    last = curves.block_norms[-1]
    return [
        _over(
            "block-norm spread, first 150 steps", max(map(_spread, curves.block_norms[:150])), 1e4
        ),
        # The input side of the stack is the starved one.
        _under("block 0 / last block norm, last step", last[0] / last[-1], 1e-4),
        _under(
            "|end loss - unigram entropy|", abs(_median(curves.loss[-30:]) - UNIGRAM_ENTROPY), 0.2
        ),
    ]


def _starved(norms: list[float]) -> float:
    """Median over smallest per-block gradient norm: how far the most starved block lags."""
    return _median(norms) / max(min(norms), 1e-38)


def _pre_ln_deep(curves: Curves, twins: Mapping[str, Curves]) -> list[Margin]:
    # No starved block: the smallest norm against the median, not the largest, since pre-LN's
    # first block gets ~30-90x the gradient of its last one (the residual stream's input end),
    # balanced though the stack is. Post-LN's median block gets ~1e4x its smallest's.
    lags = sorted(map(_starved, curves.block_norms))
    post = _median(twins["post-ln-deep"].loss[-30:])
    return [
        _under("median / smallest block norm, 95th percentile", lags[int(0.95 * len(lags))], 10),
        _over("post-LN end loss - pre-LN end loss", post - _median(curves.loss[-30:]), 0.15),
    ]


_CLAIMS: dict[str, Callable[[Curves, Mapping[str, Curves]], list[Margin]]] = {
    "healthy": _healthy,
    "spike": _spike,
    "spike-sgd": _spike_sgd,
    "diverge": _diverge,
    "surge": _surge,
    "nan": _nan,
    "nan-16-true": _nan_16_true,
    "softmax-fp16": _softmax_fp16,
    "stall": _stall,
    "post-ln-deep": _post_ln_deep,
    "pre-ln-deep": _pre_ln_deep,
}

TWINS = {"surge": "healthy", "pre-ln-deep": "post-ln-deep"}
"""The run a scenario's claim compares with (same seed and threads)."""


def claims(name: str, curves: Curves, twins: Mapping[str, Curves]) -> list[Margin]:
    """The margins of scenario ``name``'s claim on ``curves``; ``twins`` maps each name in
    ``TWINS[name]`` to its run."""
    return _CLAIMS[name](curves, twins)
