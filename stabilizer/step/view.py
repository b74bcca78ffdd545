"""`RunView`: what a host's front end shows of its run (the same on every host)."""

from __future__ import annotations

from stabilizer.core.records import Finding

from .guard import StepGuard
from .measurement import Probes
from .monitor import RunMonitor

__all__ = ["RunView"]


class RunView:
    """What a host's front end (the Lightning callback, a loop's `Stabilizer`, the HF callback)
    shows of its `run`: nothing before the run starts, the last run's after it."""

    run: RunMonitor | None

    @property
    def findings(self) -> list[Finding]:
        """Every finding of the run so far (every rank), in order."""
        return self.run.findings if self.run is not None else []

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps whose update did not happen (the guard's skips and undos, the fp16
        grad scaler's skips)."""
        return self.run.skipped_steps if self.run is not None else 0

    @property
    def guard(self) -> StepGuard | None:
        """The optimizers' guard."""
        return self.run.guard if self.run is not None else None

    @property
    def probes(self) -> Probes | None:
        """The run's probes (None before the run, or if they could not be built)."""
        return self.run.probes if self.run is not None else None

    @property
    def root_causes(self) -> int:
        """Root-cause replays run."""
        return self.run.root_causes if self.run is not None else 0
