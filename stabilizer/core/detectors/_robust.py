"""Robust rolling statistics and the spike-episode tracker of `LossSpike` and `GradSpike`."""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from stabilizer.core.records import Finding

from .base import check_at_least

__all__ = [
    "MAD_TO_SIGMA",
    "Bumps",
    "Classify",
    "Regime",
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
        """The median of the values (the window must not be empty)."""
        return _middle(self.ordered)

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


class Bumps:
    """The largest rise above the baseline of the last ``size`` records: the run's own bumps.

    A median and a MAD describe the bulk of a run's values; real gradient norms and per-step
    losses also have a heavy tail: a run whose norm sits within 5% of its median may show a 3x
    bump every few thousand steps and be healthy. A value is outsized for *this* run only when
    it also clears the bumps the run has shown lately, spikes reported included, so that a run
    whose bumps recur gets one episode for them, not one per bump. A sliding maximum: the
    candidates are kept in a deque, oldest first and decreasing, so each push costs O(1)
    amortised.
    """

    def __init__(self, size: int) -> None:
        check_at_least("size", size, 1)
        self.size = size
        self.count = 0  # records pushed
        self.kept: deque[tuple[int, float]] = deque()  # (record index, rise), rises decreasing

    def largest(self) -> float:
        """The largest rise of the last ``size`` records (0 when there is none)."""
        kept = self.kept
        while kept and kept[0][0] <= self.count - self.size:
            kept.popleft()
        return kept[0][1] if kept else 0.0

    def push(self, rise: float) -> None:
        """One record's rise above its baseline (a fall counts as 0)."""
        self.count += 1
        kept = self.kept
        while kept and kept[-1][1] <= rise:
            kept.pop()
        if rise > 0.0:
            kept.append((self.count, rise))

    def state(self) -> dict[str, Any]:
        """The count and the kept rises, as plain data."""
        return {"count": self.count, "kept": [list(pair) for pair in self.kept]}

    def load(self, state: Mapping[str, Any] | None) -> None:
        """Restore from `state` (None: a checkpoint of an earlier version, no bumps)."""
        state = state or {"count": 0, "kept": []}
        self.count = int(state["count"])
        self.kept = deque((int(i), float(r)) for i, r in state["kept"])


class Regime:
    """One episode per regime: the run's recent bumps, and the spikes folded into the last one
    reported.

    A spike that is no larger than the bumps the run has shown lately (`Bumps`, its own earlier
    spikes among them) is the run's regime, not news: it is folded into the spike reported last,
    and `close` says, once, how many were folded and until which step (an update of that
    episode: same kind, step and location).
    """

    def __init__(self, memory: int) -> None:
        self.bumps = Bumps(memory)
        self.reported: dict[str, Any] | None = None  # the last spike reported, as a dict
        self.folded = 0  # spikes folded into it
        self.until = 0  # the last step of the last one folded

    def report(self, finding: Finding) -> Finding:
        """``finding`` is reported: later spikes of its size fold into it."""
        self.reported, self.folded = finding.to_dict(), 0
        return finding

    def fold(self, last_step: int) -> None:
        """A spike of the regime, ending at ``last_step``, folds into the one reported last."""
        if self.reported is not None:
            self.folded, self.until = self.folded + 1, last_step

    def new(self) -> None:
        """A new level: a new regime, its bumps start over."""
        self.bumps = Bumps(self.bumps.size)

    def close(self) -> Finding | None:
        """End of the stream: the update of the spike reported last, if spikes folded into it."""
        if self.reported is None or not self.folded:
            return None
        first = Finding.from_dict(self.reported)
        more = "1 more" if self.folded == 1 else f"{self.folded} more"
        evidence = {**first.evidence, "repeats": float(self.folded), "until": float(self.until)}
        self.reported = None
        return replace(
            first, seen=f"{first.seen}; {more} like it until step {self.until}", evidence=evidence
        )

    def state(self) -> dict[str, Any]:
        """The bumps and the fold, as plain data."""
        return {
            "bumps": self.bumps.state(),
            "reported": self.reported,
            "folded": self.folded,
            "until": self.until,
        }

    def load(self, state: Mapping[str, Any] | None) -> None:
        """Restore from `state` (None: a checkpoint of an earlier version: no bumps, no fold)."""
        state = state or {}
        self.bumps.load(state.get("bumps"))
        self.reported = state.get("reported")
        self.folded, self.until = int(state.get("folded", 0)), int(state.get("until", 0))


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
            spike = self.classify(value, self.window)
            if spike is None:
                self.window.push(value)
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
