"""`RunChanges`, `falls`, `made_new_level`: a loss at a new level the run made, for `LossSpike`.

A divergence is a failure; a new level is not. A run changes itself at a step: it starts on a
dataloader it had not used (a second stage, a curriculum's next part: the live monitor's
``new_data`` signal), or its scheduler restarts the LR (SGDR's warm restarts, a schedule started
over). The loss then jumps to a new level, and from there falls at its usual rate. Such a jump
is judged from its new level; one that does not fall (it holds, or climbs on) is still a
divergence, whatever the run changed. Why: docs/findings.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from stabilizer.core.signals import LR, NEW_DATA

from ._trend import Trend

__all__ = [
    "RunChanges",
    "ends_far",
    "fall_rate",
    "falls",
    "learns",
    "made_new_level",
    "new_level",
]

_RESTART = 1.5  # an LR at least this multiple of the record before's has restarted...
_KNOWN = 1.05  # ...when it is at most this multiple of the highest LR the run used before
_LEARNS = 3.0  # standard errors below flat that make the slope of a new level's losses a fall
_UNMARKED = 10  # records from which a new level the log says nothing of can show its fall
_FAR = 10.0  # a log that ends with its last two losses this multiple of the baseline diverged
_NEW, _JUMP, _STILL = 10, 1.5, 1.2  # `new_level`: records, the jump, where it still is


class RunChanges:
    """The last step at which the run changed itself, and what it did.

    An LR restart is an LR that rises `_RESTART`× or more over the record before to a level the
    run has used before (at most `_KNOWN`× its highest LR so far). A warm-up sets a new highest
    LR at every step, and an LR surge past anything the run used (the ``diverge`` scenario's
    3000×) is no restart: neither is a change the run made to itself in this sense.
    """

    def __init__(self) -> None:
        self.step: int | None = None  # the step of the last change
        self.why = ""  # what the run did there
        self.lr: float | None = None  # the LR of the record before (None: none yet)
        self._peak = 0.0  # the highest LR so far

    def update(self, step: int, values: Mapping[str, float]) -> None:
        """Look at one record's ``new_data`` and ``lr``."""
        if NEW_DATA in values and values[NEW_DATA] >= 0.5:
            self.step, self.why = step, "the run started on new data"
        lr = values.get(LR)
        last = self.lr
        if lr is None or lr == last or not 0.0 < lr < math.inf:
            return  # (an LR as before: no restart, no new peak)
        if last is not None and lr >= _RESTART * last and lr <= _KNOWN * self._peak:
            self.step, self.why = step, f"the LR restarted ({last:.3g} -> {lr:.3g})"
        self.lr = lr
        if lr > self._peak:
            self._peak = lr

    def since(self, step: int) -> str:
        """What the run did, if it changed itself at ``step`` or later; else ""."""
        return self.why if self.step is not None and self.step >= step else ""

    def state(self) -> dict[str, Any]:
        """The last change and the LR history, as plain data."""
        return {"step": self.step, "why": self.why, "lr": self.lr, "peak": self._peak}

    def load(self, state: Mapping[str, Any] | None) -> None:
        """Restore from `state` (None: a checkpoint of an earlier version, no change seen)."""
        state = state or {}
        step, lr = state.get("step"), state.get("lr")
        self.step = None if step is None else int(step)
        self.why = str(state.get("why", ""))
        self.lr = None if lr is None else float(lr)
        self._peak = float(state.get("peak", 0.0))


def fall_rate(values: Sequence[float]) -> float:
    """How fast ``values`` fall, per record: the mean of their first third less that of their
    last third, over the records between (negative when they rise; 0 for fewer than 3)."""
    if len(values) < 3:
        return 0.0
    third = len(values) // 3
    first = math.fsum(values[:third]) / third
    last = math.fsum(values[-third:]) / third
    return (first - last) / (len(values) - third)


def falls(values: Sequence[float], usual: float, rel: float = 0.02) -> bool:
    """Whether a loss at a new level (``values``, in order) falls at its usual rate: at least
    half of ``usual`` (the fall per record before the change, 0 when it did not fall), and by
    more than ``rel`` of its level over the records, so that noise about a flat level is no fall.
    """
    if len(values) < 3:
        return False
    rate = fall_rate(values)
    return rate > 0.0 and rate >= 0.5 * usual and rate * len(values) > rel * abs(values[0])


def learns(values: Sequence[float]) -> bool:
    """Whether a loss learns over ``values`` (in order): the least-squares line through them
    falls `_LEARNS` standard errors below flat (`Trend`), so that the swings of a loss thrown
    about at a high level are no fall, however large."""
    trend = Trend()
    for value in values:
        trend.add(value)
    return trend.falling(0.0, t=_LEARNS)


def new_level(before: float, losses: Sequence[float]) -> bool:
    """Whether the loss went to a new level and learns it, over ``losses`` (in order) against
    the loss ``before`` them: it jumped (its first loss `_JUMP` times ``before`` or more), it
    learns since (`learns`, over `_NEW` records or more), and it is still above where it was
    (`_STILL` times): a new task or stage, not one bad batch whose loss came back. `GradSpike`
    asks it of a gradient-norm bump: the gradient of a new task is larger while it is learnt
    (the harm benchmark's staged-internal, new-task: 12x for ~40 steps), and the loss's new
    level is `LossSpike`'s to judge."""
    if before <= 0.0 or len(losses) < _NEW or losses[0] < _JUMP * before:
        return False
    last = sorted(losses[-3:])[len(losses[-3:]) // 2]
    return last > _STILL * before and learns(losses)


def made_new_level(episode: dict[str, Any]) -> bool:
    """Whether a `LossSpike` jump that stayed up (its ``episode``) is a new level the run made, not
    a failure: the loss falls from it at its usual rate where the run said it changed itself
    there (new data, an LR restart); where the log says nothing (a new task or a loss term
    inside one dataset), over `_UNMARKED` records or more it falls at least as fast, for its
    new level, as it fell before the jump, and it learns (`_level.learns`: a fall record
    after record, not noise about a level), whatever the size of the jump: a new task's loss
    starts far above the old one's (a classifier relabelled: 0.09 -> 7.35, 80x) and is
    learnt down at the usual pace. A run thrown into a worse region does not learn there: it
    holds, climbs, or swings (the ``diverge`` scenario: 290-970 for good after its 115x
    jump, no trend); docs/findings.md."""
    losses, usual = episode.get("losses", []), float(episode.get("usual", 0.0))
    if "change" in episode:
        return falls(losses, usual)
    base = float(episode["baseline"])
    if len(losses) < _UNMARKED or base <= 0.0:
        return False
    return falls(losses, 2.0 * usual * losses[0] / base) and learns(losses)


def ends_far(episode: dict[str, Any]) -> bool:
    """Whether the log ends with the loss far above its baseline: its last two losses `_FAR`
    times it or more. No batch's noise goes there and comes back unseen; the excerpt ended
    before it could settle (ZSD-SC-Resolver#24: 0.85, then 2.44, 63,119 and 1.08e13)."""
    base, recent = float(episode["baseline"]), episode.get("recent", [])
    return base > 0.0 and len(recent) >= 2 and min(recent[-2:]) >= _FAR * base
