"""`CostMeter`: the monitor's own host time, measured by part, against the run's step time.

Each of the monitor's hooks, the guard's judge and the activation probes' forward hooks run
inside `CostMeter.part`; a part nested in another (a root-cause replay inside the judge) counts
for itself alone. The window opens at the second batch (the first pays one-time work: the
preflight, building the probes) and closes at the last batch's end. The result, a
`stabilizer.core.run.Cost`, goes on the console's end line and into the JSONL's last line; above
the budget the monitor warns once, naming the part that costs most and the knob that lowers it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from stabilizer.core.run import Cost

__all__ = ["CAUSES", "WARN_AFTER", "CostMeter", "budget_verdict", "over_budget_advice"]

WARN_AFTER = 20
"""Optimizer steps measured before the monitor judges its cost against the budget, and between
two of its judgements (a batch's end costs no sum and sort of the parts in between)."""

CAUSES: Mapping[str, tuple[str, str]] = {
    "measure": (
        "measuring each step (gradient norms, the weights' check)",
        "policy='observe' drops the weights' check",
    ),
    "guard": ("the guard's decision inside each optimizer step", "policy='observe' has no guard"),
    "report": ("the detection engine", "fewer detectors (detectors=...)"),
    "loggers": (
        "the Trainer's loggers (each logged step's values)",
        "a larger Trainer(log_every_n_steps=...): the monitor logs at Lightning's cadence",
    ),
    "tensorboard": (
        "TensorBoard's extras (log10 norms, heatmap, findings table)",
        "a larger Trainer(log_every_n_steps=...) or heatmap_every",
    ),
    "jsonl": ("writing stability.jsonl, every step", "jsonl=False"),
    "console": ("the console's lines", "logging.getLogger('stabilizer').setLevel(WARNING)"),
    "notify": ("sending notifications", "notify=None"),
    "activations": ("sampled activation maxima", "a larger activation_every (0: none)"),
    "replay": ("root-cause replays of failing steps", "root_cause=False"),
}
"""Each part: what it is, and the knob that lowers it."""


class CostMeter:
    """Host seconds per part, the window's wall time and its optimizer steps.

    Args:
        budget: The share of the step time above which `check` warns (None: never).
    """

    def __init__(self, budget: float | None = 0.03) -> None:
        self.budget = budget
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.waited = 0.0  # of those, seconds spent waiting for the device
        self._stack: list[list[float]] = []  # [start, time of nested parts]
        self._batches = 0
        self._opened: tuple[float, int] | None = None  # (time, global step) at the window start
        self._closed: tuple[float, int] | None = None
        self._judged = 0  # window steps at the last judgement of the budget
        self.warned = False

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Count the time inside as `name` (less the parts nested in it)."""
        frame = [time.perf_counter(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            self._stack.pop()
            elapsed = time.perf_counter() - frame[0]
            self.seconds[name] += elapsed - frame[1]
            if self._stack:
                self._stack[-1][1] += elapsed

    def add(self, name: str, seconds: float) -> None:
        """Time measured elsewhere (the activation probes' hooks, the device waits)."""
        self.seconds[name] += seconds

    def batch_start(self, step: int) -> None:
        """A training batch starts (`step`: the Trainer's global step)."""
        self._batches += 1
        if self._batches == 2:  # the window opens: what the first batch cost is left out
            self._opened = (time.perf_counter(), step)
            self.seconds.clear()
            self.waited = 0.0

    def batch_end(self, step: int) -> Cost | None:
        """A training batch ended; `step` is the global step after it. Returns the figures
        once, when they exceed the budget (`check`): the caller warns."""
        if self._opened is not None:
            self._closed = (time.perf_counter(), step)
        return self.check()

    def cost(self) -> Cost | None:
        """The window's figures so far; None before one optimizer step was measured."""
        if self._opened is None or self._closed is None:
            return None
        steps = self._closed[1] - self._opened[1]
        wall = self._closed[0] - self._opened[0]
        if steps < 1 or wall <= 0:
            return None
        total = sum(self.seconds.values())
        parts = tuple(sorted(((k, v * 1e3 / steps) for k, v in self.seconds.items() if v > 0),
                             key=lambda kv: -kv[1]))  # fmt: skip
        return Cost(
            steps, total * 1e3 / steps, total / wall, self.waited * 1e3 / steps, parts,
            self.budget, self.warned,
        )  # fmt: skip

    def check(self) -> Cost | None:
        """The figures, once, when they exceed the budget: judged every `WARN_AFTER` steps
        measured, from the `WARN_AFTER`-th."""
        if self.warned or self._opened is None or self._closed is None:
            return None
        steps = self._closed[1] - self._opened[1]
        if steps < self._judged + WARN_AFTER:
            return None
        self._judged = steps
        cost = self.cost()
        if cost is None or not cost.over_budget:
            return None
        self.warned = True
        return cost


def over_budget_advice(cost: Cost) -> str:
    """``"over its 3% budget: mostly sampled activation maxima (2.1 ms/step); try ..."``."""
    budget = f"over its {cost.budget:.0%} budget" if cost.budget is not None else "over budget"
    if not cost.parts:
        return budget
    name, ms = cost.parts[0]
    what, knob = CAUSES.get(name, (name, ""))
    advice = f"{budget}: mostly {what} ({ms:.1f} ms/step)"
    return advice + (f"; to lower it: {knob}" if knob else "")


def budget_verdict(cost: Cost) -> str:
    """The whole run against the budget, for the end line: `over_budget_advice` when over it;
    within it, said so only where the monitor warned otherwise during the run (`Cost.warned`),
    so the end line never leaves that warning standing."""
    if cost.budget is None:
        return ""
    if cost.over_budget:
        return over_budget_advice(cost)
    if cost.warned:
        return f"within its {cost.budget:.0%} budget over the whole run"
    return ""
