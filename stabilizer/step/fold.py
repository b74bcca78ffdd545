"""`Fold`: repeats of one kind of finding at one severity that the console has not printed yet,
summed up in one line (`stabilizer.step.console`), naming the largest of them."""

from __future__ import annotations

from dataclasses import dataclass

from stabilizer.core.records import Finding
from stabilizer.outputs.wording import counted

__all__ = ["Fold"]


@dataclass
class Fold:
    """Repeats of one (kind, severity) not printed yet, and the largest of them."""

    first: int
    last: int
    count: int = 1  # findings
    skipped: bool = True
    steps: int = 1  # the distinct steps among them
    largest: Finding | None = None

    def add(self, finding: Finding) -> None:
        """Count one more repeat; keep the largest (by its ratio, else its peak)."""
        if finding.step != self.last and self.count:
            self.steps += 1
        self.last, self.count = finding.step, self.count + 1
        if self.largest is None or _size(finding) > _size(self.largest):
            self.largest = finding

    def text(self, noun: str) -> str:
        """``"NaN/Inf loss at 5 more steps (70…102)"``; several findings at one step (one in
        each of 19 modules) are ``"overflow_risk in 19 more places at step 200"``; where the
        repeats differ in size, the largest is said (a 47.9x spike is never hidden behind the
        2.2x one printed first)."""
        if self.steps == 1 and self.count > 1:
            text = f"{noun} in {self.count} more places at step {self.first}"
        else:
            span = f"{self.first}…{self.last}" if self.last != self.first else str(self.first)
            more = f", {self.count} findings" if self.count > self.steps else ""
            text = f"{noun} at {counted(self.steps, 'more step')} ({span}){more}"
        if self.largest is not None and _size(self.largest) > 0 and self.count > 1:
            text += f"; the largest: {self.largest.observation}"
        elif self.largest is not None and _size(self.largest) > 0:
            text += f": {self.largest.observation}"
        return text


def _size(finding: Finding) -> float:
    """How large a finding is, to compare repeats of its kind: its ratio, else its peak."""
    evidence = finding.evidence
    size = evidence.get("ratio", evidence.get("peak", 0.0))
    return size if size == size else 0.0  # (NaN: no size)
