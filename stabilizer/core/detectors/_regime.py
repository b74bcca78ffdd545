"""The run's own bumps, for `LossSpike` and `GradSpike`: `Regime`, one episode per regime of
spikes; `Early`, the spikes of a stream's first records, judged once the run has shown its bumps.

In its first records a run's batch-to-batch noise is not known yet: a from-scratch regression
with batch 16 doubles its loss and comes back at step 3, again at step 8 and at step 12 (issue
#39, under `StabilityMonitor()`); each looked like a spike against the two or three records
before it, and each was only the run's own noise. So a spike that comes back while the baseline
is shorter than `LossSpike`'s ``min_history`` is held, and judged when the baseline reaches it
(or the stream ends): reported if it rose ``tail_ratio`` times the largest rise of every other
record seen so far, the other held spikes among them, as the long-log rule judges a spike against
the run's recent bumps (`Regime`). One outsized jump among quiet records is still a spike
(BigScience 104B: 3.06, 3.11, then 7.71); three alike fold into each other.

A jump that stays up while the baseline is short is judged by what followed it (`never_back`):
a divergence never comes back within the range its few records before it showed; a noisy run's
jump off two low first records does, among its noise.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from stabilizer.core.records import Finding

from .base import check_at_least

__all__ = ["Bumps", "Early", "Regime", "never_back"]


class Bumps:
    """The largest rise above the baseline of the last ``size`` records: the run's own bumps.

    A median and a MAD describe the bulk of a run's values; real gradient norms and per-step
    losses also have a heavy tail: a run whose norm sits within 5% of its median may show a 3x
    bump every few thousand steps and be healthy. A value is outsized for *this* run only when
    it also clears the bumps the run has shown lately, spikes reported included, so that a run
    whose bumps recur gets one episode for them, not one per bump. Each record's rise goes into
    a bounded deque (C's append, every record); the maximum is taken when a spike opens, rarely.
    """

    def __init__(self, size: int) -> None:
        check_at_least("size", size, 1)
        self.size = size
        self.rises: deque[float] = deque(maxlen=size)  # the last `size` rises, oldest first

    def largest(self) -> float:
        """The largest rise of the last ``size`` records (0 when there is none)."""
        return max(0.0, max(self.rises, default=0.0))

    def push(self, rise: float) -> None:
        """One record's rise above its baseline (a fall counts as 0)."""
        self.rises.append(rise)

    def state(self) -> dict[str, Any]:
        """The last rises, as plain data."""
        return {"rises": list(self.rises)}

    def load(self, state: Mapping[str, Any] | None) -> None:
        """Restore from `state` (None: a checkpoint of an earlier version, no bumps; one with
        ``count`` and ``kept``: the sliding maxima it kept, each at its place, which give the
        same largest rises from there on)."""
        state = state or {}
        if "rises" in state:
            rises = [float(r) for r in state["rises"]]
        else:
            count = int(state.get("count", 0))
            rises = [0.0] * min(count, self.size)
            for index, rise in state.get("kept", []):
                at = int(index) - (count - len(rises)) - 1
                if 0 <= at < len(rises):
                    rises[at] = float(rise)
        self.rises = deque(rises, maxlen=self.size)


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


_KEEP = 4  # records' rises kept, in multiples of the records held for (bounded memory)


class Early:
    """The rises of the first records (`LossSpike` appends each record's, `keep` at most) and
    the spikes held among them.

    Args:
        records: Baseline records from which spikes are judged at once (``min_history``).
        tail_ratio: A held spike is reported if it rose this many times the others' largest rise.
    """

    def __init__(self, records: int, tail_ratio: float) -> None:
        self.records, self.tail_ratio = records, tail_ratio
        self.keep = _KEEP * records  # rises noted at most (bounded memory)
        self.done = False  # the first records are over: nothing is held any more
        self.rises: list[tuple[int, float]] = []  # (step, rise over its baseline), `keep` at most
        self.held: list[dict[str, Any]] = []  # the spikes that came back, with "back" (steps)

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
