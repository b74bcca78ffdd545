"""`OverflowRisk`: activations approaching the fp16 limit, before they overflow."""

from __future__ import annotations

import math
from itertools import pairwise
from typing import Any, ClassVar

from stabilizer.core.kinds import OVERFLOW_RISK, kind_of
from stabilizer.core.records import Finding, Severity, StepRecord
from stabilizer.core.run import RunHeader
from stabilizer.core.signals import ACT_ABSMAX_PREFIX

from .base import check_at_least, check_fraction

__all__ = ["FP16_MAX", "OverflowRisk", "computes_in_fp16"]

FP16_MAX = 65504.0  # the largest finite float16


class OverflowRisk:
    """A module whose activations approach the fp16 maximum (65504): an overflow in the making.

    Requires: ``act_absmax/<module>`` (max |output| per module, on sampled steps only).
    Rule: absmax > fraction·65504, or ≥ min_level after `samples` samples each ≥ `growth`× the last.

    Activation statistics are sampled (every N steps), so the records are sparse and the growth rule
    counts samples of that module, not steps. Reported at once, with the module as location: the
    remedy (keep that module in fp32, or train in bf16) must land before the overflow does. An Inf
    absmax has overflowed already and is reported too. An episode ends when the value is back under
    half the limit and no longer growing; the module can then be reported again.

    The fp16 range matters only where the run computes in fp16: once the run's header says its
    precision (`set_run`: the live monitor's, or the one a ``stability.jsonl`` opens with), an
    fp32, fp64 or bf16 run gets no such warning (bf16 has fp32's range). A run whose precision
    is not known is watched.

    Args:
        fraction: Fraction of the fp16 maximum that counts as too close.
        growth: Per-sample growth factor that counts as geometric growth.
        samples: Consecutive growing samples needed.
        min_level: Growth below this absmax is ignored (small activations double harmlessly).
    """

    name: ClassVar[str] = "overflow_risk"
    requires: ClassVar[tuple[str, ...]] = (ACT_ABSMAX_PREFIX,)

    def __init__(
        self, fraction: float = 0.25, growth: float = 2.0, samples: int = 3, min_level: float = 1e3
    ) -> None:
        check_fraction("fraction", fraction)
        check_at_least("growth", growth, 1.0)
        check_at_least("samples", samples, 1)
        check_at_least("min_level", min_level, 0.0)
        self.limit, self.growth, self.samples, self.min_level = (
            fraction * FP16_MAX,
            growth,
            samples,
            min_level,
        )
        self._history: dict[str, list[float]] = {}  # module -> its last samples + 1 finite values
        self._open: set[str] = set()  # modules with an open (already reported) episode
        self._fp16: bool | None = None  # whether the run computes in fp16 (None: not known)
        self.done = False  # a run known not to compute in fp16: nothing to judge (`set_run`)

    def set_run(self, run: RunHeader) -> None:
        """What the run is: only a run that computes in fp16 can overflow fp16's range."""
        self._fp16 = computes_in_fp16(run.precision)
        self.done = self._fp16 is False

    def update(self, record: StepRecord) -> list[Finding]:
        if self.done:  # (the engine stops feeding it then; a direct caller may not)
            return []
        findings = []
        for key, value in record.values.items():
            if not key.startswith(ACT_ABSMAX_PREFIX) or math.isnan(value):
                continue
            module = key[len(ACT_ABSMAX_PREFIX) :]
            finding = self._update_module(record.step, module, abs(value))
            if finding is not None:
                findings.append(finding)
        return findings

    def _update_module(self, step: int, module: str, value: float) -> Finding | None:
        history = self._history.setdefault(module, [])
        if math.isfinite(value):
            history.append(value)
            del history[: -(self.samples + 1)]
        growth = _growth(history) if len(history) == self.samples + 1 else 0.0
        growing = value >= self.min_level and growth >= self.growth
        if not (value > self.limit or growing):
            if value < self.limit / 2:
                self._open.discard(module)
            return None
        if module in self._open:
            return None
        self._open.add(module)
        share = f"{value / FP16_MAX:.0%} of the fp16 max" if math.isfinite(value) else "overflowed"
        trend = f", growing {growth:.1f}x per sample" if growing else ""
        return Finding(
            kind=OVERFLOW_RISK,
            step=step,
            end_step=step,
            severity=Severity.WARNING,
            seen=f"activations of {module} reach {value:.3g} ({share}){trend} at step {step}",
            evidence={"absmax": value, "limit": self.limit, "growth": growth},
            location=(module,),
            remedies=kind_of(OVERFLOW_RISK).remedies,
            advice="keep this module in fp32 or train in bf16",
        )

    def finish(self) -> list[Finding]:
        return []

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": {module: list(values) for module, values in self._history.items()},
            "open": sorted(self._open),
            "fp16": self._fp16,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._history = {m: [float(v) for v in values] for m, values in state["history"].items()}
        self._open = {str(module) for module in state["open"]}
        fp16 = state.get("fp16")  # absent in checkpoints of earlier rounds
        self._fp16 = None if fp16 is None else bool(fp16)
        self.done = self._fp16 is False


def computes_in_fp16(precision: str) -> bool | None:
    """Whether a precision (Lightning's names: ``"16-mixed"``, ``"16-true"``, ``"bf16-mixed"``,
    ``"32-true"``, ..., or ``"fp16"``) computes in fp16; None when it is not known (``""``)."""
    if not precision:
        return None
    name = precision.strip().lower()
    return name.startswith("16") or name in ("fp16", "half", "float16")


def _growth(history: list[float]) -> float:
    """The smallest ratio between consecutive values (0 when a value is not positive)."""
    return min(b / a if a > 0 else 0.0 for a, b in pairwise(history))
