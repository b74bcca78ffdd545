"""`Reporter`: an ended step becomes a record, the engine's findings and the outputs' lines.

Each optimizer is its own stream: with several (manual optimization: a GAN's two losses), the
steps of the first feed the engine and the outputs under the usual keys, and those of optimizer
k (from 2) feed an engine of their own, their record's keys prefixed ``opt<k>/`` and their
findings' text ``optimizer k: ...`` (two losses of different levels in one stream would be a
"spike" at every other step).

On the CPU a step is reported at its own block end. From an accelerator its numbers are read a
step later, once the device has later work queued (`defer`), so that no step waits for Python.
The remedies answer each reported step; what they did is reported with it, and their answer
to "stop?" goes back to the run. An error in reporting stops the reports, with one warning,
never the training or the protection.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from stabilizer.core.engine import Engine, is_restart
from stabilizer.core.isolated import isolated
from stabilizer.core.records import Finding, StepRecord
from stabilizer.core.run import RunEnd

from .cost import CostMeter
from .host import Host
from .live_outputs import LiveOutputs, stream_record
from .protect import Remedies
from .step import OptimizerStep

__all__ = ["Reporter"]

log = logging.getLogger("stabilizer")

_GO = (False, "")


def _of_optimizer(i: int, found: list[Finding]) -> list[Finding]:
    """Findings of optimizer `i`'s stream, said as such (the first optimizer's as they are)."""
    return [replace(f, seen=f"optimizer {i + 1}: {f.seen}") for f in found] if i else found


class Reporter:
    """Reports the run's steps, now or one step late.

    Args:
        host: The training loop.
        make_engine: Makes a fresh detection engine (one per optimizer).
        outputs: Where records and findings go.
        cost: The monitor's cost meter (reporting is a part of it).
        remedies: The policy's remedies (they answer each step's findings).
        strict: Raise an internal error instead of stopping the reports.
        on_restart: Called when a remedy restarted training from a snapshot.
    """

    def __init__(
        self,
        host: Host,
        make_engine: Callable[[], Engine],
        outputs: LiveOutputs,
        cost: CostMeter,
        remedies: Remedies,
        strict: bool,
        on_restart: Callable[[], None] = lambda: None,
    ) -> None:
        self.host, self.make_engine, self.outputs, self.cost = host, make_engine, outputs, cost
        self.engines = [make_engine()]  # one per optimizer, by its index in the host's
        self.remedies, self.strict, self._on_restart = remedies, strict, on_restart
        self.findings: list[Finding] = []
        self.defer: bool | None = None  # None: by the device (CUDA: yes); tests force it
        self.last: OptimizerStep | None = None  # the last step reported
        self._pending: OptimizerStep | None = None  # ended, its report deferred to the next
        self._working = True  # False after an internal error in reporting

    def steps(self, steps: Sequence[OptimizerStep]) -> tuple[bool, str]:
        """The block's ended steps: each reported now, or held until the next step; the
        remedies' ``(should_stop, reason)`` after those reported."""
        answer = _GO
        for step in steps:
            defer = self.defer
            if defer is None:
                m = step.measurement
                defer = m is not None and m.numbers is not None and m.numbers.on_device
            if defer:
                answer = self.pending() if not answer[0] else answer
                self._pending = step
            else:
                answer = self._safely_report(step) if not answer[0] else answer
        return answer

    def pending(self) -> tuple[bool, str]:
        """Report the step held back, if any: the remedies' ``(should_stop, reason)``."""
        pending, self._pending = self._pending, None
        return self._safely_report(pending) if pending is not None else _GO

    def _safely_report(self, step: OptimizerStep) -> tuple[bool, str]:
        self.safely(self._report, step)
        step.report()
        self.last = step
        return self.remedies.should_stop()

    def emit(self, record: StepRecord | None, found: list[Finding], stream: int = 0) -> None:
        """Keep the findings (every rank); rank 0 writes them, and the record (of optimizer
        `stream` + 1), out."""
        self.findings.extend(found)
        if self.host.facts.is_global_zero:
            self.outputs.write(record, found, stream)

    def finish(self, skipped: int, intact: bool | None, stopped: str) -> None:
        """The engine's last findings, then the run's end to every output (``stopped``: why
        the monitor stopped the run, "" where it did not)."""
        for i, engine in enumerate(self.engines):
            self.emit(None, _of_optimizer(i, engine.finish()))
        end = RunEnd(self.host.step, skipped, intact, self.cost.cost(), stopped)
        self.outputs.close(end)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the engines, the findings, the remedies."""
        return {
            "engine": self.engines[0].state_dict(),
            "engines": [engine.state_dict() for engine in self.engines[1:]],
            "findings": [f.to_dict() for f in self.findings],
            "auto": self.remedies.state_dict() or None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Back to a checkpoint's `state_dict`."""
        self.engines[0].load_state_dict(state["engine"])
        for engine_state in state.get("engines", []):
            self.engines.append(self.make_engine())
            self.engines[-1].load_state_dict(engine_state)
        self.findings = [Finding.from_dict(f) for f in state["findings"]]
        if state.get("auto"):
            self.remedies.load_state_dict(state["auto"])

    @property
    def engine(self) -> Engine:
        """The first optimizer's engine (the only one, with one optimizer)."""
        return self.engines[0]

    def _engine(self, i: int) -> Engine:
        while len(self.engines) <= i:
            self.engines.append(self.make_engine())
        return self.engines[i]

    def safely(self, fn: Callable[..., None], *args: Any) -> None:
        """Run one piece of reporting; an error stops the reports (one warning), not the run."""
        if not self._working:
            return
        error = isolated(self.strict, fn, *args)
        if error is not None:
            self._working = False
            log.warning(
                "stabilizer stopped reporting after an internal error (the protection "
                "stays on): %r",
                error,
                exc_info=error,
            )

    def _report(self, step: OptimizerStep) -> None:
        with self.cost.part("report"):
            values, i = step.values(), step.optimizer_index
            record = StepRecord(step.step, values) if values is not None else None
            found = _of_optimizer(i, self._engine(i).observe(record) if record else [])
            found += step.found
            self.emit(record, found, i)
            if record is not None:  # (the remedies act on the first optimizer's stream)
                done = self.remedies.after_step(step.step, found, stream_record(record, i))
                if any(map(is_restart, done)):
                    for engine in self.engines:
                        engine.restart()
                    self._on_restart()
                if done:
                    self.emit(None, done)
        m = step.measurement
        numbers = m.numbers if m is not None else None
        self.cost.waited += numbers.waited if numbers is not None else 0.0
