"""`Regime`: one episode per regime of spikes, for `LossSpike` and `GradSpike`."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from stabilizer.core.records import Finding

from .base import check_at_least

__all__ = ["Bumps", "Regime"]


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
