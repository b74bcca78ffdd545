"""`LiveOutputs`: everything a step record or a finding goes to, behind one protocol.

Notifications, the host's loggers, ``stability.jsonl``, the console and TensorBoard's extras
are each an `Output`: ``write(record, found)`` per reported step (a None record: findings only)
and ``close(end)`` once, at the end. Every output gets the findings as `LiveFacts` advise them
(`stabilizer.core.advice`: only the remedies that fit the run), the same advice everywhere. They
open on rank 0 only. An output that raises stops with one warning; the others, and the
protection, go on (a full disk stops the JSONL, not the console).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from torch import nn

from stabilizer import __version__
from stabilizer.core.advice import RunFacts, advised
from stabilizer.core.isolated import isolated
from stabilizer.core.records import Finding, StepRecord
from stabilizer.core.run import RunEnd, RunHeader, low_precision
from stabilizer.core.signals import LOSS_SCALE, SKIPPED
from stabilizer.outputs.jsonl import JsonlWriter
from stabilizer.outputs.notify import Notifier, as_notifier

from .console import Console
from .host import HostFacts
from .live_tensorboard import TensorBoardOutput

__all__ = [
    "JsonlOutput",
    "LiveFacts",
    "LiveOutputs",
    "LoggerOutput",
    "MetricsLogger",
    "NotifyOutput",
    "Output",
    "Sinks",
    "run_header",
    "stream_record",
]

log = logging.getLogger("stabilizer")


class Output(Protocol):
    """Where the monitor's records and findings go. An output that speaks only of findings is
    not given a quiet step (a record without findings) while its `quiet` is False, as the
    engine feeds no records to a detector that is ``done``."""

    name: str
    quiet: bool  # it takes a quiet step's record now

    def write(self, record: StepRecord | None, found: Sequence[Finding]) -> None: ...

    def close(self, end: RunEnd) -> None: ...


class MetricsLogger(Protocol):
    """A logger of metrics by step (Lightning's loggers are)."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...


@dataclass(frozen=True)
class Sinks:
    """Where a host's records may go besides the monitor's own outputs.

    Args:
        loggers: The host's loggers (records under ``stability/``).
        every: Their cadence: log every N steps (and every step with a finding).
        tensorboard: A ``SummaryWriter`` for TensorBoard's extras (heatmap, findings table).
    """

    loggers: Sequence[MetricsLogger] = ()
    every: int = 1
    tensorboard: Any = None


class JsonlOutput:
    """``stability.jsonl``: the run's header, each record and finding, the end line."""

    name = "jsonl"
    quiet = True

    def __init__(self, writer: JsonlWriter) -> None:
        self.writer = writer

    def write(self, record: StepRecord | None, found: Sequence[Finding]) -> None:
        for item in ([record] if record is not None else []) + list(found):
            self.writer.write(item)

    def close(self, end: RunEnd) -> None:
        self.writer.write(end)
        self.writer.close()


class LoggerOutput:
    """The Trainer's loggers: the records' values under ``stability/`` at Lightning's cadence
    (``Trainer(log_every_n_steps=...)``, as its own callbacks log), and every step that has a
    finding, with each finding's severity, together with the steps its episode started and
    peaked at (a spike reported when it is over would be missing from the loss chart between
    two steps of the cadence). Those earlier steps come from the records held since the last
    step logged, so every logger gets its steps in order (TensorBoard drops the points after
    a step that goes back).

    Args:
        loggers: The host's loggers.
        every: Their cadence (``trainer.log_every_n_steps``).
    """

    name = "loggers"
    quiet = True

    def __init__(self, loggers: Sequence[MetricsLogger], every: int = 1) -> None:
        self.loggers, self.every = list(loggers), max(1, every)
        self._held: deque[StepRecord] = deque(maxlen=min(self.every, _HELD))

    def write(self, record: StepRecord | None, found: Sequence[Finding]) -> None:
        if record is None:
            return
        if not (found or (record.step + 1) % self.every == 0):
            self._held.append(record)
            return
        wanted = {step for f in found for step in _episode_steps(f)}
        for earlier in self._held:
            if earlier.step in wanted:
                self._log(earlier, {})
        self._held.clear()
        self._log(record, {f"stability/finding/{f.kind}": float(f.severity) for f in found})

    def _log(self, record: StepRecord, findings: dict[str, float]) -> None:
        metrics = {f"stability/{k}": v for k, v in record.values.items()} | findings
        for logger in self.loggers:
            logger.log_metrics(metrics, step=record.step)

    def close(self, end: RunEnd) -> None:
        """The loggers are the host's: it closes them."""


_HELD = 1000  # records held back at most (a cadence of more steps holds the latest ones)


def _episode_steps(finding: Finding) -> tuple[int, ...]:
    """The steps a finding's episode is drawn at: its first step and its peak."""
    peak = finding.evidence.get("peak_step", math.nan)
    return (finding.step, int(peak)) if math.isfinite(peak) else (finding.step,)


class NotifyOutput:
    """Notifications (`stabilizer.outputs.notify.Notifier`), sent from a background thread."""

    name = "notify"
    quiet = False  # it sends findings only

    def __init__(self, notifier: Notifier) -> None:
        self.notifier = notifier

    def write(self, record: StepRecord | None, found: Sequence[Finding]) -> None:
        self.notifier.notify(list(found))

    def close(self, end: RunEnd) -> None:
        self.notifier.close()


class LiveFacts:
    """A live run's facts as its steps come, and its findings advised by them
    (`stabilizer.core.advice.advised`, the rule every output follows). The live outputs are
    its only user: it takes every reported step's record here, beside them, and asks the
    advice's module only when a step has findings to advise.

    Args:
        precision: The trainer's precision (``"32-true"``, ``"bf16-mixed"``; ``""``: unknown).
        spans: Spans of skipped steps remembered (the latest): findings are about recent steps.
    """

    def __init__(self, precision: str = "", spans: int = 64) -> None:
        self.facts = RunFacts(low_precision=low_precision(precision), precision=precision)
        self.spans = spans

    def see(self, step: int, values: Mapping[str, float]) -> None:
        """Take one step's record: was its update skipped, does the run scale its loss."""
        if LOSS_SCALE in values and not self.facts.fp16:
            self.facts = replace(self.facts, fp16=True)
        if values.get(SKIPPED, 0.0) >= 0.5:
            facts = self.facts.with_skipped(step)
            self.facts = replace(facts, skipped=facts.skipped[-self.spans :])

    def advise(self, found: Sequence[Finding]) -> list[Finding]:
        """The findings of one step as the outputs show them, each with the others of its
        step as context (a NaN's root cause comes with it)."""
        return [advised(finding, self.facts, found) for finding in found]


class LiveOutputs:
    """The outputs of one monitor, opened at fit start (rank 0), each isolated from the others.

    Args:
        console: The console output (it also counts what the end line says).
        jsonl: The JSONL setting of ``StabilityMonitor`` (a path, True for the default, False).
        notify: The notification setting of ``StabilityMonitor``.
        heatmap_every: Steps between TensorBoard heatmaps.
        strict: Raise an output's error instead of stopping that output.
        part: The monitor's cost meter's `part`: each output's time is counted under its name.
    """

    def __init__(
        self,
        console: Console,
        jsonl: str | Path | bool,
        notify: Notifier | str | None,
        heatmap_every: int,
        strict: bool,
        part: Callable[[str], AbstractContextManager[None]] | None = None,
    ) -> None:
        self.console, self.jsonl, self.heatmap_every, self.strict = (
            console, jsonl, heatmap_every, strict,
        )  # fmt: skip
        self._part = part or (lambda name: nullcontext())
        self.notifier = as_notifier(notify)
        self.default_path: Path | None = None  # the default JSONL of this run, kept for a resume
        self.writer: JsonlWriter | None = None
        self.facts = LiveFacts()  # the run's facts so far: what advice fits
        self._outputs: list[Output] = []
        self._broken: set[str] = set()

    def open(
        self,
        facts: HostFacts,
        module: nn.Module,
        groups: Sequence[str] | None,
        grouping: Callable[[str], str] | None,
        earlier: Sequence[Finding],
        policy: str,
        sinks: Sinks,
    ) -> None:
        """Open every output (rank 0); `earlier`: the findings before a resume."""
        if not facts.is_global_zero:
            return
        self.facts = LiveFacts(facts.precision)
        if self.notifier is not None:
            self._outputs.append(NotifyOutput(self.notifier))
        if sinks.loggers:
            self._outputs.append(LoggerOutput(sinks.loggers, sinks.every))
        if self.jsonl is not False:
            path = self._default_jsonl(facts) if self.jsonl is True else Path(str(self.jsonl))
            header = run_header(facts, policy, groups or ())
            self._safely("jsonl", self._open_jsonl, path, header)
        if groups is None:  # the probes could not be built: no depth groups to show
            return
        written = self.writer.path if self.writer is not None else None
        self.console.start(module, groups, grouping, written)
        self._outputs.append(self.console)
        if sinks.tensorboard is not None:
            self._outputs.append(TensorBoardOutput(
                sinks.tensorboard, list(groups), self.heatmap_every, earlier, sinks.every
            ))  # fmt: skip

    @property
    def path(self) -> Path | None:
        """The JSONL being written (None: none)."""
        return self.writer.path if self.writer is not None else None

    def write(self, record: StepRecord | None, found: Sequence[Finding], stream: int = 0) -> None:
        """One reported step (or findings alone) to every output, the findings advised.

        A step of optimizer k (`stream` k - 1, from 2) is written with its keys prefixed
        ``opt<k>/`` (its own stream in the logs); the console reads its fate (skipped, checked)
        from its own keys, whatever the stream."""
        if record is not None and stream == 0:
            self.facts.see(record.step, record.values)
        if found:
            found = self.facts.advise(found)
        logged = stream_record(record, stream) if record is not None else None
        for out in self._outputs:
            if not (found or out.quiet):
                continue
            with self._part(out.name):
                self._safely(out.name, out.write, record if out is self.console else logged, found)

    def close(self, end: RunEnd) -> None:
        """The end of the run to every output, each closed."""
        for out in self._outputs:
            self._safely(out.name, out.close, end)
        self._outputs = []

    def abort(self) -> None:
        """The run died: close the files and the notifier (every line written is flushed)."""
        if self.writer is not None:
            self.writer.close()
        if self.notifier is not None:
            self.notifier.close()

    def _open_jsonl(self, path: Path, header: RunHeader) -> None:
        self.writer = JsonlWriter(path)
        self.writer.write(header)  # the run's facts first
        self._outputs.append(JsonlOutput(self.writer))

    def _default_jsonl(self, facts: HostFacts) -> Path:
        """Beside the logs; without a log dir, a new version directory per run (not on a
        resume, which keeps its own path from the checkpoint)."""
        if facts.log_dir is not None:
            return facts.log_dir / "stability.jsonl"
        if self.default_path is None:
            root = facts.root_dir / "stability_logs"
            free = next(v for v in itertools.count() if not (root / f"version_{v}").exists())
            self.default_path = root / f"version_{free}" / "stability.jsonl"
        return self.default_path

    def _safely(self, name: str, fn: Callable[..., object], *args: Any) -> None:
        """One output's work: an error stops that output (one warning), not the others."""
        if name in self._broken:
            return
        error = isolated(self.strict, fn, *args)
        if error is not None:
            self._broken.add(name)
            log.warning(
                "stabilizer: the %s output stopped after an error (the other outputs and "
                "the protection go on): %r",
                name,
                error,
            )


def stream_record(record: StepRecord, stream: int) -> StepRecord:
    """A step of optimizer `stream` + 1 as its stream logs it: from the second optimizer on,
    its keys prefixed ``opt<k>/``."""
    if not stream:
        return record
    return StepRecord(record.step, {f"opt{stream + 1}/{k}": v for k, v in record.values.items()})


def run_header(facts: HostFacts, policy: str, groups: Sequence[str]) -> RunHeader:
    """The run's facts that ``stability.jsonl`` opens with (the replayed report needs what the
    live monitor knows: an fp32 run gets no fp32 islands as advice)."""
    return RunHeader(
        precision=facts.precision, accelerator=facts.accelerator, devices=max(1, facts.devices),
        strategy=facts.strategy, world_size=max(1, facts.world_size), policy=policy,
        groups=tuple(groups), version=__version__,
    )  # fmt: skip
