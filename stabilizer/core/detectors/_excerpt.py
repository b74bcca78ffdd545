"""`short_spike`: `LossSpike`'s rule for a pasted excerpt, when few losses make the baseline.

On a few records σ says little, so the jump must be larger and stand out of the stretch's own
spread: a doubling counts at once; a smaller jump of `min_ratio` counts only if it stays up
("provisional": BigScience tr8b-104B right after a resume, 2.67 then 4.4 and staying); a loss
that rose record after record is measured from where the rise began ("rise": Megatron averages
the loss over the log interval, so one bad iteration is a ramp, 6.37, 6.60, 7.31, 9.12, 10.24);
a loss that has been falling (a warm-up: 12, 9, 4, 2.6, 1.9) is measured against the level it
has reached (1.9), not the median of its fall, and must give back a quarter of that fall at
least (8 gives back 60% of 12 -> 1.9: a spike; near a loss's floor, where one hard batch
multiplies a level of 4e-5 by hundreds, a ratio says nothing and a share of the fall does); three
records at least make a fall: one low record after a high one is a dip (a partial logging window,
357.8 then 14.8), not a level reached. A jump
back to the loss the run started from (its first record at step 0 or 1), where it had come down
by a sixth or more, counts whatever its ratio, and at once: it undid all the run had learnt (a
GPT-2 LoRA run evaluated every 500 steps, 9.23 at step 0, 6.95, 6.58, 6.65, then 9.58: back to
its untrained level, 1.4x; then 6.64). An excerpt from mid-run does not show that level: its
first loss is one batch's (EfficientDet's 0.289, 0.263, 0.209, then 0.303: noise).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any, Protocol

from ._robust import RobustWindow

__all__ = ["GIVES_BACK", "UNDONE", "Bars", "climbing", "short_spike", "stays"]

GIVES_BACK = 0.25
"""The share of its fall a falling excerpt's jump must give back to be judged at all: a smaller
one leaves the loss where the fall had it a record or two before (a classifier's 0.109 ... 3.9e-5,
then 0.0153: 394x its level, 14% of its fall, one harder batch of a task it has solved)."""

UNDONE = 1.2
"""How far below the loss it started from (1/1.2 of it, or lower) a run must have come for a jump
back to that loss to count whatever its ratio: the jump undid all it had learnt."""


class Bars(Protocol):
    """The thresholds `short_spike` reads (a `LossSpike`'s arguments)."""

    k: float
    rel_floor: float
    min_ratio: float
    min_jump: float
    short_ratio: float
    recover_k: float


def short_spike(
    loss: float, window: RobustWindow, bars: Bars, start: float | None = None
) -> tuple[float, float, str] | None:
    """``(baseline, recovery limit, how)`` when ``loss`` is a spike over the few losses of
    ``window``, else None; ``how`` is ``""``, ``"provisional"`` (it must stay up) or ``"rise"``.
    ``start``: the loss the run started from, where the log shows its start (else None).

    The jump is a doubling of a positive level, or `min_jump` over one that is not (no ratio of
    a level at or below 0); a level of exactly 0 with no spread is no baseline at all (#31).
    """
    values = window.values
    falling = len(values) >= 3 and all(b <= a for a, b in pairwise(values))
    undone = start is not None and len(values) >= 3 and loss >= start >= UNDONE * min(values)
    start = _rise_start(values, loss)
    spread: RobustWindow | None = window if not falling else None
    how = ""
    if start is not None:
        med, how, spread = values[start], "rise", _window([*values][: start + 1])
    else:
        med = values[-1] if falling else window.median()
    ratio = bars.short_ratio if start is None else bars.min_ratio
    low, high = med * bars.min_ratio, med * ratio
    if med <= 0:
        low = high = med + bars.min_jump
    if loss < low and not undone:
        return None
    if falling and loss - med < GIVES_BACK * (values[0] - med):
        return None  # (a jump within the fall the excerpt shows: see the module's docstring)
    if loss < high and not undone:
        if len(values) < 2:
            return None
        how = "provisional"
    band = bars.rel_floor * abs(med)
    if spread is not None and len(spread) > 1:
        band = max(spread.sigma(spread.median()), band)
    if band <= 0.0 or loss <= med + bars.k * band:
        return None
    return med, med + bars.recover_k * band, how


def stays(loss: float, episode: Mapping[str, Any], bars: Bars, zero: bool) -> bool:
    """Whether a jump that counts only if it stays up ("provisional") still does: after a single
    record (not step 0's alone: ``zero``), at least `short_ratio` times it; else at least
    halfway to the `min_ratio` bar over the baseline."""
    base = episode["baseline"]
    if episode["baseline_records"] < 2:
        return not zero and bool(loss >= bars.short_ratio * base)
    return bool(loss >= base + 0.5 * (bars.min_ratio - 1.0) * abs(base))


def climbing(episode: Mapping[str, Any], min_ratio: float) -> bool:
    """Whether a jump that had to stay up was still climbing when the log ended: every loss of
    it above the one before, two at least, the last `min_ratio` times the baseline or more (a
    TF2 detector's 1.40 ... 1.20, then 1.77, 2.16, 2.37 as the excerpt ends). The log cannot
    show that it stayed up; it shows that it had not stopped rising."""
    losses = episode.get("losses", [])
    rising = len(losses) >= 2 and all(b > a for a, b in pairwise(losses))
    return rising and losses[-1] >= min_ratio * episode["baseline"]


def _rise_start(values: Sequence[float], loss: float) -> int | None:
    """Where a rise record after record began, when ``loss`` ends one of 3 rises or more."""
    index = len(values) - 1
    if index < 2 or not loss > values[index]:
        return None
    while index > 0 and values[index - 1] < values[index]:
        index -= 1
    return index if len(values) - index >= 3 else None


def _window(values: list[float]) -> RobustWindow:
    window = RobustWindow(max(1, len(values)))
    for value in values:
        window.push(value)
    return window
