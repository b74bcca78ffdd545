"""A bounded, downsampled history of the signals a plot or a heatmap needs.

A diagnosis streams: no list of every record is kept. For pictures the report keeps at most
`History.capacity` bins. Each bin covers a run of consecutive records (``width`` of them) and
holds, per series, the minimum, the maximum and the last finite value and how many values were
non-finite. When the bins are full, neighbours merge two by two and the width doubles, so memory
depends on the number of bins and series, never on the length of the log.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from stabilizer.core.signals import GRAD_NORM, GRAD_NORM_PREFIX, LOSS, LOSS_SCALE, LR, SKIPPED

__all__ = ["TRACKED", "Bin", "History", "Series"]

TRACKED = frozenset({LOSS, GRAD_NORM, LOSS_SCALE, LR, SKIPPED})
"""Signal keys kept, besides every per-group gradient norm (``grad_norm/<group>``)."""


@dataclass
class Bin:
    """Consecutive records: their steps, segment and per-series [min, max, last, non-finite].

    ``min``, ``max`` and ``last`` are NaN until a finite value arrives.
    """

    first_step: int
    last_step: int
    segment: int
    count: int = 0
    series: dict[str, list[float]] = field(default_factory=dict)

    def merge(self, later: Bin) -> None:
        """Fold the bin that follows this one into it."""
        self.last_step, self.segment = later.last_step, later.segment
        self.count += later.count
        for key, (low, high, last, bad) in later.series.items():
            entry = self.series.get(key)
            if entry is None:
                self.series[key] = [low, high, last, bad]
                continue
            entry[0] = low if not entry[0] <= low else entry[0]
            entry[1] = high if not entry[1] >= high else entry[1]
            entry[2] = last if math.isfinite(last) else entry[2]
            entry[3] += bad


@dataclass(frozen=True)
class Series:
    """One signal over the bins that hold it, as plain lists of equal length.

    ``steps`` is each bin's last step; ``nonfinite`` counts its non-finite values.
    """

    steps: list[int]
    segments: list[int]
    low: list[float]
    high: list[float]
    last: list[float]
    nonfinite: list[int]


class History:
    """The last-step-indexed, downsampled history of `TRACKED` signals and per-group norms.

    Args:
        capacity: The most bins kept (an even number, at least 2).

    Raises:
        ValueError: ``capacity`` is odd or below 2.
    """

    def __init__(self, capacity: int = 512) -> None:
        if capacity < 2 or capacity % 2:
            raise ValueError(f"`capacity` must be an even number >= 2, got {capacity}")
        self.capacity = capacity
        self.width = 1  # records per bin
        self.bins: list[Bin] = []
        self.records = 0

    def add(self, step: int, segment: int, values: Mapping[str, float]) -> None:
        """Fold one record into the history (a new segment starts a new bin).

        Time and memory go with the record's keys, not with every key seen before.
        """
        self.records += 1
        current = self.bins[-1] if self.bins else None
        if current is None or current.count >= self.width or current.segment != segment:
            if len(self.bins) == self.capacity:
                self._compact()
            current = Bin(step, step, segment)
            self.bins.append(current)
        current.count += 1
        current.last_step = step
        series = current.series
        for key, value in values.items():  # (folded here, not in a call a value: the hot loop)
            if key not in TRACKED and not key.startswith(GRAD_NORM_PREFIX):
                continue
            entry = series.get(key)
            if entry is None:
                entry = series[key] = [math.nan, math.nan, math.nan, 0.0]
            if math.isfinite(value):
                if not value >= entry[0]:  # also when entry[0] is NaN
                    entry[0] = value
                if not value <= entry[1]:
                    entry[1] = value
                entry[2] = value
            else:
                entry[3] += 1

    def _compact(self) -> None:
        merged = []
        for index in range(0, len(self.bins) - 1, 2):
            first = self.bins[index]
            first.merge(self.bins[index + 1])
            merged.append(first)
        if len(self.bins) % 2:
            merged.append(self.bins[-1])
        self.bins = merged
        self.width *= 2

    def keys(self) -> set[str]:
        """Every series key seen."""
        return {key for one in self.bins for key in one.series}

    def nonfinite_keys(self) -> set[str]:
        """The series that had a non-finite value."""
        return {key for one in self.bins for key, entry in one.series.items() if entry[3]}

    def groups(self) -> list[str]:
        """The depth groups of the per-group gradient norms seen (unordered names)."""
        size = len(GRAD_NORM_PREFIX)
        return sorted(key[size:] for key in self.keys() if key.startswith(GRAD_NORM_PREFIX))

    def series(self, key: str) -> Series:
        """The series of ``key`` over the bins that hold it (empty lists when none does)."""
        out = Series([], [], [], [], [], [])
        for one in self.bins:
            entry = one.series.get(key)
            if entry is None:
                continue
            out.steps.append(one.last_step)
            out.segments.append(one.segment)
            out.low.append(entry[0])
            out.high.append(entry[1])
            out.last.append(entry[2])
            out.nonfinite.append(int(entry[3]))
        return out

    def matrix(self, groups: list[str]) -> tuple[list[int], list[list[float]]]:
        """Per-group gradient norms (bin maxima) as rows, one column per bin, and the steps.

        A bin with a non-finite norm of a group holds NaN there (a heatmap shows it); a bin
        without the group repeats the group's previous value (its first, at the start).
        """
        rows = []
        for group in groups:
            key = GRAD_NORM_PREFIX + group
            cells = [one.series.get(key) for one in self.bins]
            rows.append(_filled([None if e is None else math.nan if e[3] else e[1] for e in cells]))
        return [one.last_step for one in self.bins], rows


def _filled(cells: list[float | None]) -> list[float]:
    """``cells`` with each gap (None) holding the value before it; leading gaps the first value."""
    previous = next((cell for cell in cells if cell is not None), math.nan)
    out = []
    for cell in cells:
        if cell is not None:
            previous = cell
        out.append(previous)
    return out
