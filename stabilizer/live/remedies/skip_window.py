"""`SkipWindow`: the steps whose updates a rollback skips, so the bad batches are stepped past."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SkipWindow"]


@dataclass
class SkipWindow:
    """Which steps to skip after a rollback: those from `since` up to, not including, `until`.

    Attributes:
        since: First step skipped.
        until: First step no longer skipped; ``since == until`` (no window) before `start`.
    """

    since: int = 0
    until: int = 0

    def start(self, step: int, count: int) -> int:
        """Skip the `count` steps from `step` on, extending a window still open; returns
        the new `until`."""
        if count < 0:
            raise ValueError(f"`count` must be >= 0, got {count}")
        if self.active(step):
            self.until = max(self.until, step + count)
        else:
            self.since, self.until = step, step + count
        return self.until

    def active(self, step: int) -> bool:
        """Whether `step` is to be skipped."""
        return self.since <= step < self.until
