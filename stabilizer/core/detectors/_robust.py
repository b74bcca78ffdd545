"""Robust rolling statistics and the spike-episode tracker of `LossSpike` and `GradSpike`."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .base import check_at_least

__all__ = [
    "MAD_TO_SIGMA",
    "Classify",
    "RobustWindow",
    "SpikeTracker",
    "exp10",
    "finite",
    "median",
]

MAD_TO_SIGMA = 1.4826  # MAD x this = the standard deviation, for normally distributed data


def finite(values: Mapping[str, float], key: str) -> float | None:
    """``values[key]`` when present and finite, else None."""
    value = values.get(key)
    return value if value is not None and math.isfinite(value) else None


def median(values: Sequence[float]) -> float:
    """The median of a non-empty sequence."""
    return _middle(sorted(values))


def _middle(ordered: Sequence[float]) -> float:
    """The median of a non-empty sorted sequence."""
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * ordered[mid - 1] + 0.5 * ordered[mid]


def exp10(x: float) -> float:
    """``10 ** x``, but inf instead of an OverflowError past the float range."""
    return 10.0**x if x < 308.25 else math.inf


class RobustWindow:
    """The last ``size`` values, with their median and MAD-based standard deviation.

    Median and MAD ignore a few outliers entirely (up to half the window), where a mean and a
    standard deviation are dragged by them: one spike of 8.0 in a window of 2.5s moves the mean but
    not the median.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.values: deque[float] = deque(maxlen=size)

    def __len__(self) -> int:
        return len(self.values)

    def push(self, value: float) -> None:
        """Append a finite value, dropping the oldest when full."""
        self.values.append(value)

    def clear(self) -> None:
        """Forget everything (re-baseline)."""
        self.values.clear()

    def stats(self) -> tuple[float, float]:
        """``(median, sigma)``: sigma is ``MAD_TO_SIGMA`` times the median absolute deviation."""
        ordered = sorted(self.values)
        med = _middle(ordered)
        return med, _sigma(ordered, med)

    def state(self) -> list[float]:
        """The values, oldest first."""
        return list(self.values)

    def load(self, values: Iterable[float]) -> None:
        """Replace the values (from `state`)."""
        self.values.clear()
        self.values.extend(float(v) for v in values)


def _sigma(ordered: Sequence[float], med: float) -> float:
    return MAD_TO_SIGMA * _middle(sorted([abs(v - med) for v in ordered]))


Classify = Callable[[float, float, float], "float | None"]
"""``(value, median, sigma) -> recovery limit`` when the value is a spike, else None."""


class SpikeTracker:
    """A robust baseline frozen during spikes, and the spike episode's bookkeeping.

    `observe` feeds one finite value. Outside a spike the value either opens an episode (the
    ``classify`` callable says it is a spike and under which limit it counts as over) or joins the
    baseline. Inside, it extends the episode (start, last, peak, peak_step, baseline, limit) until
    a value falls back under the limit (``"recovered"``) or the episode outlasts
    ``recovery_window`` steps (``"stuck"``: the baseline restarts from the new level).
    """

    def __init__(
        self, window: int, min_history: int, recovery_window: int, classify: Classify
    ) -> None:
        check_at_least("window", window, 2)
        check_at_least("min_history", min_history, 2)
        if min_history > window:
            raise ValueError(f"`min_history` must be <= window ({window}), got {min_history}")
        check_at_least("recovery_window", recovery_window, 1)
        self.window = RobustWindow(window)
        self.min_history, self.recovery_window = min_history, recovery_window
        self.classify = classify
        self.episode: dict[str, Any] | None = None

    def observe(self, step: int, value: float) -> tuple[str, dict[str, Any]] | None:
        """Feed one value; ``(outcome, episode)`` when an episode ends, else None."""
        episode = self.episode
        if episode is None:
            if len(self.window) >= self.min_history:
                med, sigma = self.window.stats()
                limit = self.classify(value, med, sigma)
                if limit is not None:
                    self.episode = {"start": step, "last": step, "peak": value, "peak_step": step}
                    self.episode.update(baseline=med, limit=limit)
                    return None
            self.window.push(value)
            return None
        if value <= episode["limit"]:
            self.episode = None
            self.window.push(value)
            return "recovered", episode
        episode["last"] = step
        if value > episode["peak"]:
            episode["peak"], episode["peak_step"] = value, step
        if step - episode["start"] <= self.recovery_window:
            return None
        self.episode = None
        self.window.clear()  # a lasting shift: re-baseline on the new level
        self.window.push(value)
        return "stuck", episode

    def close(self) -> dict[str, Any] | None:
        """End of stream: the open episode, if any, now closed."""
        episode, self.episode = self.episode, None
        return episode

    def state(self) -> dict[str, Any]:
        """The baseline values and the open episode."""
        episode = None if self.episode is None else dict(self.episode)
        return {"window": self.window.state(), "episode": episode}

    def load(self, state: Mapping[str, Any]) -> None:
        """Restore from `state`."""
        self.window.load(state["window"])
        self.episode = None if state["episode"] is None else dict(state["episode"])
