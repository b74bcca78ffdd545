"""`Reporter`: a measured step becomes a record, the engine's findings and the outputs' lines.

Each optimizer is its own stream: with several (manual optimization: a GAN's two losses), the
steps of the first feed the engine and the outputs under the usual keys, and those of optimizer
k (from 2) feed an engine of their own, their record's keys prefixed ``opt<k>/`` and their
findings' text ``optimizer k: ...`` (two losses of different levels in one stream would be a
"spike" at every other step).

On the CPU a step is reported at its own batch end. From an accelerator its numbers are read a
step later, once the device has later work queued (`defer`), so that no step waits for Python.
An error in reporting stops the reports, with one warning, never the training or the protection.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from stabilizer.core.engine import Engine, is_restart
from stabilizer.core.isolated import Isolated
from stabilizer.core.records import Finding, StepRecord
from stabilizer.core.run import RunEnd

from .auto import AutoRemedies
from .batch import InFlight
from .cost import CostMeter, over_budget_advice
from .host import Host
from .live_outputs import LiveOutputs
from .protect import Protection

__all__ = ["Reporter"]

log = logging.getLogger("stabilizer")


def _of_optimizer(i: int, found: list[Finding]) -> list[Finding]:
    """Findings of optimizer `i`'s stream, said as such (the first optimizer's as they are)."""
    return [replace(f, seen=f"optimizer {i + 1}: {f.seen}") for f in found] if i else found


class Reporter:
    """Reports the monitor's steps, now or one step late.

    Args:
        host: The training loop.
        make_engine: Makes a fresh detection engine (one per optimizer).
        outputs: Where records and findings go.
        cost: The monitor's cost meter (reporting is a part of it; it warns over budget).
        auto: The remedies of policy ``auto`` (they answer each step's findings), or None.
        protection: The protection (it stops the run when ``auto`` has no rollback left).
        strict: Raise an internal error instead of stopping the reports.
    """

    def __init__(
        self,
        host: Host,
        make_engine: Callable[[], Engine],
        outputs: LiveOutputs,
        cost: CostMeter,
        auto: AutoRemedies | None,
        protection: Protection | None,
        strict: bool,
    ) -> None:
        self.host, self.make_engine, self.outputs, self.cost = host, make_engine, outputs, cost
        self.engines = [make_engine()]  # one per optimizer, by its index in the host's
        self.auto, self.protection, self.strict = auto, protection, strict
        self.findings: list[Finding] = []
        self.defer: bool | None = None  # None: by the device (CUDA: yes); tests force it
        self._pending: InFlight | None = None  # stepped, its report deferred to the next step
        self._working = True  # False after an internal error in reporting

    def steps(self, steps: Sequence[InFlight]) -> None:
        """The batch's optimizer steps: each reported now, or held until the next step."""
        for step in steps:
            defer = self.defer
            if defer is None:
                numbers = step.measurement.numbers
                defer = numbers is not None and numbers.on_device
            if defer:
                self.pending()
                self._pending = step
            else:
                self.safely(self._report, step)

    def pending(self) -> None:
        """Report the step held back, if any."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self.safely(self._report, pending)

    def emit(self, record: StepRecord | None, found: list[Finding]) -> None:
        """Keep the findings (every rank); rank 0 writes them, and the record, out."""
        self.findings.extend(found)
        if self.host.facts.is_global_zero:
            self.outputs.write(record, found)

    def finish(self, skipped: int, intact: bool | None) -> None:
        """The engine's last findings, then the run's end to every output."""
        for i, engine in enumerate(self.engines):
            self.emit(None, _of_optimizer(i, engine.finish()))
        self.outputs.close(RunEnd(self.host.step, skipped, intact, self.cost.cost()))

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the engine, the findings, the remedies, the protection."""
        state: dict[str, Any] = {
            "engine": self.engines[0].state_dict(),
            "engines": [engine.state_dict() for engine in self.engines[1:]],
            "findings": [f.to_dict() for f in self.findings],
            "auto": self.auto.state_dict() if self.auto is not None else None,
        }
        return state | (self.protection.state_dict() if self.protection is not None else {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Back to a checkpoint's `state_dict`."""
        self.engines[0].load_state_dict(state["engine"])
        for engine_state in state.get("engines", []):
            self.engines.append(self.make_engine())
            self.engines[-1].load_state_dict(engine_state)
        self.findings = [Finding.from_dict(f) for f in state["findings"]]
        if self.auto is not None and state.get("auto"):
            self.auto.load_state_dict(state["auto"])
        if self.protection is not None:
            self.protection.load_state_dict(state)

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
        with Isolated(self.strict) as part:
            fn(*args)
        if part.error is not None:
            self._working = False
            log.warning(
                "stabilizer stopped reporting after an internal error (the protection "
                "stays on): %r",
                part.error,
                exc_info=part.error,
            )

    def _report(self, step: InFlight) -> None:
        with self.cost.part("report"):
            outcome = step.outcome()
            values, i = outcome.values, outcome.measurement.optimizer_index
            record = StepRecord(step.step, values) if values is not None else None
            found = _of_optimizer(i, self._engine(i).observe(record) if record else [])
            found += outcome.found
            if record is not None and i:
                prefixed = {f"opt{i + 1}/{k}": v for k, v in record.values.items()}
                record = StepRecord(record.step, prefixed)
            self.emit(record, found)
            auto = self.auto
            if auto is not None and record is not None:
                done = auto.after_step(step.step, found, record)
                if any(map(is_restart, done)):
                    for engine in self.engines:
                        engine.restart()
                self.emit(None, done)
                if auto.exhausted() and self.protection is not None:
                    self.protection.stop(step, auto.stop_reason)
        numbers = step.measurement.numbers
        self.cost.waited += numbers.waited if numbers is not None else 0.0
        cost = self.cost.check()
        if cost is not None and self.host.facts.is_global_zero:
            log.warning("stabilizer: %s, %s", cost.describe(), over_budget_advice(cost))
