"""Robust rolling statistics and the spike-episode tracker of `LossSpike` and `GradSpike`."""

from __future__ import annotations

import math
from bisect import bisect_left, insort
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


def median(values: Iterable[float]) -> float:
    """The median of non-empty values."""
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
    not the median. The values are kept twice: by age (to drop the oldest) and sorted (so the
    median is the middle one).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.values: deque[float] = deque()  # oldest first
        self.ordered: list[float] = []  # the same values, sorted

    def __len__(self) -> int:
        return len(self.values)

    def push(self, value: float) -> None:
        """Append a finite value, dropping the oldest when full."""
        if len(self.values) == self.size:
            del self.ordered[bisect_left(self.ordered, self.values.popleft())]
        self.values.append(value)
        insort(self.ordered, value)

    def clear(self) -> None:
        """Forget everything (re-baseline)."""
        self.values.clear()
        self.ordered.clear()

    def median(self) -> float:
        """The median of the values (the window must not be empty). (`_middle`'s line, without
        its call: asked of every record's loss and gradient norm.)"""
        ordered = self.ordered
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else 0.5 * ordered[mid - 1] + 0.5 * ordered[mid]

    def sigma(self, med: float) -> float:
        """``MAD_TO_SIGMA`` times the median absolute deviation from ``med`` (the median)."""
        return MAD_TO_SIGMA * median([abs(v - med) for v in self.ordered])

    def state(self) -> list[float]:
        """The values, oldest first."""
        return list(self.values)

    def load(self, values: Iterable[float]) -> None:
        """Replace the values (from `state`)."""
        self.clear()
        for value in values:
            self.push(float(value))


Classify = Callable[[float, RobustWindow], "tuple[float, float] | None"]
"""``(value, baseline window) -> (baseline, recovery limit)`` when the value is a spike, else
None."""


class SpikeTracker:
    """A robust baseline frozen during spikes, and the spike episode's bookkeeping.

    `observe` feeds one finite value. Outside a spike the value either opens an episode (the
    ``classify`` callable says it is a spike, against which baseline, and under which limit it
    counts as over) or joins the baseline. Inside, it extends the open `episode` (``start``,
    ``last``, ``records``, ``peak``, ``peak_step``, ``baseline``, ``baseline_records``, ``limit``)
    until a value falls back under the limit: the episode ends and `observe` returns it. What a
    long episode means (a divergence, a level shift) is the detector's to say; `rebaseline` ends
    an episode by starting the baseline over from the new level.
    """

    def __init__(self, window: int, classify: Classify) -> None:
        check_at_least("window", window, 2)
        self.window = RobustWindow(window)
        self.classify = classify
        self.episode: dict[str, Any] | None = None

    def observe(self, step: int, value: float) -> dict[str, Any] | None:
        """Feed one value; the episode it ended by falling back under the limit, else None."""
        episode = self.episode
        if episode is None:
            window = self.window
            spike = self.classify(value, window)
            if spike is None:  # (`RobustWindow.push`, without its call: most values)
                values, ordered = window.values, window.ordered
                if len(values) == window.size:
                    del ordered[bisect_left(ordered, values.popleft())]
                values.append(value)
                insort(ordered, value)
                return None
            self.episode = {"start": step, "last": step, "records": 1, "peak": value}
            self.episode.update(peak_step=step, baseline=spike[0], limit=spike[1])
            self.episode["baseline_records"] = len(self.window)
            return None
        if value <= episode["limit"]:
            self.episode = None
            self.window.push(value)
            return episode
        episode["last"], episode["records"] = step, episode["records"] + 1
        if value > episode["peak"]:
            episode["peak"], episode["peak_step"] = value, step
        return None

    def rebaseline(self, values: Iterable[float]) -> None:
        """End the open episode: a lasting shift, the baseline starts over from ``values``."""
        self.episode = None
        self.window.clear()
        for value in values:
            self.window.push(value)

    def restart(self) -> None:
        """Training went back to earlier weights: the baseline starts over from the next value
        (an open episode stays open, judged against the baseline it froze)."""
        if self.episode is None:
            self.window.clear()

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
