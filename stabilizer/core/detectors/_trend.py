"""`Trend`: whether a loss is still falling, by the least-squares line through it.

A run that learns slowly (a fine-tune at 2.12, then 2.00 by step 300 and 1.57 by step 3000)
moves less than any fixed share of its start in a few hundred steps, and its per-batch noise
can be larger than that move; yet, record after record, it falls. The slope of the line through
every loss so far, against its standard error, says so where a comparison of two medians cannot:
five sums, updated in O(1) a record.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["Trend"]

_T = 2.0  # standard errors below 0 that make a slope a fall, not noise


class Trend:
    """The least-squares line through losses ``y`` at positions 0, 1, 2, ... (their order)."""

    def __init__(self) -> None:
        self.n = 0
        self.sy = self.sxy = self.syy = 0.0

    def add(self, y: float) -> None:
        """One more loss, at the next position."""
        x = float(self.n)
        self.n += 1
        self.sy += y
        self.sxy += x * y
        self.syy += y * y

    def falling(self, by: float, t: float = _T) -> bool:
        """Whether the losses fall: the slope ``t`` standard errors below 0, and the line's fall
        over the records at least ``by``."""
        if self.n < 3:
            return False
        slope, error = self._line()
        return slope < -t * error and -slope * (self.n - 1) >= by

    def may_fall(self, by: float, noise: float, t: float = _T) -> bool:
        """Whether the losses may fall by ``by`` over the records for all they show: a line
        ``t`` standard errors steeper than the fitted one falls that far (too few records, or
        too noisy, to say the loss stays where it is). ``noise``: the losses' spread about
        their level, measured robustly by the caller (a spike the line went through would
        inflate the spread about it, and a short one says nothing of the run's noise)."""
        if self.n < 3:
            return True
        slope, _ = self._line()
        n = self.n
        error = noise / math.sqrt((n - 1) * n * (n + 1) / 12.0)  # (the positions' spread)
        return -(slope - t * error) * (n - 1) >= by

    def _line(self) -> tuple[float, float]:
        """The slope of the least-squares line and its standard error."""
        n = self.n
        sx, sxx = n * (n - 1) / 2.0, (n - 1) * n * (2 * n - 1) / 6.0  # of 0, 1, ..., n-1
        dxx = sxx - sx * sx / n
        dxy = self.sxy - sx * self.sy / n
        dyy = self.syy - self.sy * self.sy / n
        slope = dxy / dxx
        residual = max(dyy - slope * dxy, 0.0) / (n - 2)  # the variance about the line
        return slope, math.sqrt(residual / dxx)

    def state(self) -> dict[str, Any]:
        """The sums, as plain data."""
        return {"n": self.n, "sy": self.sy, "sxy": self.sxy, "syy": self.syy}

    def load(self, state: Mapping[str, Any] | None) -> None:
        """Restore from `state` (None: a checkpoint of an earlier version: no losses)."""
        state = state or {}
        self.n = int(state.get("n", 0))
        self.sy, self.sxy = float(state.get("sy", 0.0)), float(state.get("sxy", 0.0))
        self.syy = float(state.get("syy", 0.0))
