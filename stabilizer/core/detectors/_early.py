"""`Early`: the spikes of a stream's first records, judged once the run has shown its own bumps.

In its first records a run's batch-to-batch noise is not known yet: a from-scratch regression
with batch 16 doubles its loss and comes back at step 3, again at step 8 and at step 12 (issue
#39, under `StabilityMonitor()`); each looked like a spike against the two or three records
before it, and each was only the run's own noise. So a spike that comes back while the baseline
is shorter than `LossSpike`'s ``min_history`` is held, and judged when the baseline reaches it
(or the stream ends): reported if it rose ``tail_ratio`` times the largest rise of every other
record seen so far, the other held spikes among them, as the long-log rule judges a spike against
the run's recent bumps (`_regime`). One outsized jump among quiet records is still a spike
(BigScience 104B: 3.06, 3.11, then 7.71); three alike fold into each other.

A jump that stays up while the baseline is short is judged by what followed it (`never_back`):
a divergence never comes back within the range its few records before it showed; a noisy run's
jump off two low first records does, among its noise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Early", "never_back"]

_KEEP = 4  # records' rises kept, in multiples of the records held for (bounded memory)


class Early:
    """The rises of the first records and the spikes held among them.

    Args:
        records: Baseline records from which spikes are judged at once (``min_history``).
        tail_ratio: A held spike is reported if it rose this many times the others' largest rise.
    """

    def __init__(self, records: int, tail_ratio: float) -> None:
        self.records, self.tail_ratio = records, tail_ratio
        self.done = False  # the first records are over: nothing is held any more
        self.rises: list[tuple[int, float]] = []  # (step, rise over the baseline) a record
        self.held: list[dict[str, Any]] = []  # the spikes that came back, with "back" (steps)

    def note(self, step: int, rise: float) -> None:
        """One record's rise over its baseline (the median of the records before it)."""
        if len(self.rises) < _KEEP * self.records:
            self.rises.append((step, rise))  # (an int step: one past float's range is a step)

    def hold(self, episode: dict[str, Any], back: int) -> None:
        """A spike that came back after ``back`` steps, to judge later."""
        self.held.append({**episode, "back": back})

    def release(self) -> list[dict[str, Any]]:
        """The first records are over: the held spikes that stand out of the others' rises.
        Nothing is held or noted from here on."""
        found = []
        for episode in self.held:
            start, last = episode["start"], episode["last"]
            others = [rise for step, rise in self.rises if not start <= step <= last]
            largest = max(others, default=0.0)
            if episode["peak"] - episode["baseline"] >= self.tail_ratio * largest:
                found.append(episode)
        self.done, self.held, self.rises = True, [], []
        return found

    def state(self) -> dict[str, Any]:
        """The rises and the held spikes, as plain data."""
        return {"done": self.done, "rises": [list(r) for r in self.rises], "held": self.held}

    def load(self, state: Mapping[str, Any] | None) -> None:
        """Restore from `state` (None: a checkpoint of an earlier version: the first records are
        over, nothing held)."""
        state = state or {"done": True}
        self.done = bool(state.get("done", True))
        self.rises = [(int(s), float(r)) for s, r in state.get("rises", [])]
        self.held = [dict(episode) for episode in state.get("held", [])]


def never_back(before: Sequence[float], after: Sequence[float]) -> bool:
    """Whether no loss ``after`` a jump came back within the range the few losses ``before`` it
    showed (below their largest): the consequence a divergence has and a noisy run's jump does
    not. A run whose first two records happened to be low has later losses down there again,
    among its noise (a regression with Student-t targets: 1.15, then 1.9-5.9 and back to 1.4);
    one thrown off has none (mlx-examples#620: 1.59, 1.41, then 3.32-6.44 for good)."""
    return not before or min(after, default=0.0) > max(before)
