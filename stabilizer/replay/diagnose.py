"""One log through the engine: `diagnose` streams records from a reader into an `Engine`.

Records go straight from the reader to the engine; besides the findings only counters, a bounded
`History` and the notes are kept, so memory does not grow with the log.

Restarts. A run that was stopped and resumed from a checkpoint logs its steps again from the
checkpoint's step (or prints a resume banner); the readers mark each such restart with a
``restart`` note, and the run splits into *segments*. Each segment gets a fresh `Engine`: the
resumed process started with fresh detector state too (unless it restored the monitor's own), so a
fresh engine is the honest model, and an episode cannot straddle a restart (the end of a segment
closes its open episodes, as the end of a log does). The price: each segment starts with the
detectors' warm-up (20 records for the spike detectors). Findings keep the segment they came from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import NamedTuple, Protocol

from stabilizer.core.engine import Engine
from stabilizer.core.records import Finding, Severity, StepRecord
from stabilizer.core.signals import LOSS

from .history import History
from .readers import LogReadError, Note, read_log

__all__ = [
    "Diagnosis",
    "Failure",
    "Located",
    "RecordSink",
    "Segment",
    "diagnose",
    "exit_code",
    "severity_counts",
]


class RecordSink(Protocol):
    """Anything that wants every record of the stream as it passes (the TensorBoard export)."""

    def record(self, record: StepRecord) -> None:
        """Take one record."""


@dataclass
class Segment:
    """A stretch of the run between restarts.

    Args:
        index: 1-based position in the log.
        first_step: Its first step.
        last_step: Its last step.
        records: Its number of records.
        why: What gave the restart away ("" for the first segment).
        line: The log line of the restart, when known.
        nonfinite: Records whose loss is NaN or Inf.
        nonfinite_since: First step of the non-finite losses the segment ends with, or None when
            its last loss is finite.
    """

    index: int
    first_step: int
    last_step: int
    records: int = 0
    why: str = ""
    line: int | None = None
    nonfinite: int = 0
    nonfinite_since: int | None = None


LIVE_KINDS = frozenset({"root_cause", "config_risk", "causal_leak", "remedy_applied"})
"""Finding kinds only the live monitor can make: read from its log, not replayed."""


class Located(NamedTuple):
    """A finding and the segment (1-based) it was found in."""

    segment: int
    finding: Finding


@dataclass
class Diagnosis:
    """Everything the reports show about one log."""

    path: str
    format: str
    notes: list[Note]
    segments: list[Segment] = field(default_factory=list)
    findings: list[Located] = field(default_factory=list)
    history: History = field(default_factory=History)

    @property
    def records(self) -> int:
        """Records read."""
        return sum(segment.records for segment in self.segments)

    @property
    def steps(self) -> tuple[int, int] | None:
        """The first and last step logged (None when nothing was read)."""
        if not self.segments:
            return None
        return self.segments[0].first_step, self.segments[-1].last_step

    def worst(self) -> Severity | None:
        """The worst severity found, or None without findings."""
        return max((item.finding.severity for item in self.findings), default=None)


@dataclass(frozen=True)
class Failure:
    """An input that could not be diagnosed: its path and the one-line reason."""

    path: str
    message: str


def severity_counts(findings: Iterable[Finding]) -> dict[str, int]:
    """Findings per severity, every severity named (lower case), worst first."""
    counts = {severity.name.lower(): 0 for severity in sorted(Severity, reverse=True)}
    for finding in findings:
        counts[finding.severity.name.lower()] += 1
    return counts


def exit_code(outcome: Diagnosis | Failure, fail_on: Severity) -> int:
    """2 for a failure, 1 for a finding at or above ``fail_on``, else 0."""
    if isinstance(outcome, Failure):
        return 2
    return int(any(item.finding.severity >= fail_on for item in outcome.findings))


class _Run:
    """The state of one streaming diagnosis: segments, the current engine, the history."""

    def __init__(self, diagnosis: Diagnosis, sinks: Sequence[RecordSink]) -> None:
        self.diagnosis, self.sinks = diagnosis, sinks
        self.notes, self.history = diagnosis.notes, diagnosis.history  # hot-path lookups
        self.engine = Engine()
        self.segment: Segment | None = None
        self.noted = 0  # notes already scanned for restarts
        self.visible = 0  # notes left before the current batch's first record
        self.restarts: list[Note] = []  # restart notes whose segment has not begun yet

    def observe(self, record: StepRecord) -> None:
        step, segment = record.step, self.segment
        if segment is None:
            segment = self._begin(step, None)
        elif self.restarts or step < segment.last_step or self.visible > self.noted:
            segment = self._maybe_restart(step, segment)
        self._feed(segment, [record], [step])

    def observe_many(self, records: list[StepRecord], visible: int) -> None:
        """`observe` each record in turn; segments, findings and history come out the same.

        ``records`` come from `_batches`: a note that came with a record (a restart) makes it
        the first of its batch, and ``visible`` is the number of notes left by then. That record,
        and each record whose step goes back, goes through `observe` (which starts segments);
        the runs between go to the engine and the history whole.
        """
        self.visible = visible
        start, count = 0, len(records)
        every = list(map(_STEP, records))
        ordered = every == sorted(every)  # no step goes back within the batch
        while start < count:
            segment = self.segment
            if (
                segment is None
                or self.restarts
                or self.visible > self.noted
                or every[start] < segment.last_step  # the step goes back here: a new segment
            ):
                self.observe(records[start])
                start += 1
                continue
            end = count
            if not ordered:  # up to where it goes back next
                end = next((i for i in range(start + 1, count) if every[i] < every[i - 1]), count)
            run = records[start:end] if start or end < count else records
            self._feed(segment, run, every[start:end])
            start += len(run)

    def _feed(self, segment: Segment, run: list[StepRecord], steps: list[int]) -> None:
        """Count a run of records of ``segment`` (its steps ``steps``, not going back), and hand
        it to the engine, the history and the sinks."""
        self._count(segment, run, steps)
        for record in run:
            self._keep(self.engine.observe(record))
        self.history.add_many(run, segment.index)
        for sink in self.sinks:
            for record in run:
                sink.record(record)

    @staticmethod
    def _count(segment: Segment, run: list[StepRecord], steps: list[int]) -> None:
        """`_feed`'s counts: records, last step, non-finite losses."""
        segment.records += len(run)
        segment.last_step = steps[-1]
        losses = [loss for record in run if (loss := record.values.get(LOSS)) is not None]
        total = sum(losses)
        if total - total == 0.0:  # all finite (a finite sum has no NaN or Inf in it)
            if losses:
                segment.nonfinite_since = None
            return
        for step, record in zip(steps, run, strict=True):
            loss = record.values.get(LOSS)
            if loss is None:
                continue
            if loss - loss == 0.0:
                segment.nonfinite_since = None
            else:
                segment.nonfinite += 1
                if segment.nonfinite_since is None:
                    segment.nonfinite_since = step

    def _maybe_restart(self, step: int, segment: Segment) -> Segment:
        notes = self.diagnosis.notes
        self.restarts += [n for n in notes[self.noted : self.visible] if n.kind == "restart"]
        self.noted = max(self.noted, self.visible)
        pending = self.restarts[0] if self.restarts else None
        if pending is not None and (step == pending.step or step < segment.last_step):
            return self._begin(step, self.restarts.pop(0))
        if step < segment.last_step:  # a restart the reader did not note
            why = f"restart: step went back from {segment.last_step} to {step}"
            return self._begin(step, Note("restart", why, None, step))
        return segment

    def _begin(self, step: int, note: Note | None) -> Segment:
        if self.segment is not None:
            self.finish()
            self.engine = Engine()
        why, line = ("", None) if note is None else (note.message, note.line)
        self.segment = Segment(len(self.diagnosis.segments) + 1, step, step, why=why, line=line)
        self.diagnosis.segments.append(self.segment)
        return self.segment

    def finish(self) -> None:
        self._keep(self.engine.finish())

    def keep_live(self, stored: list[Finding]) -> None:
        """The monitor's own findings of a ``stability.jsonl`` that no replay can derive (the
        root cause of a NaN, preflight, remedies applied), each in the segment of its step."""
        for finding in stored:
            if finding.kind in LIVE_KINDS:
                segments = self.diagnosis.segments
                index = next(
                    (s.index for s in reversed(segments) if s.first_step <= finding.step), 1
                )
                self.diagnosis.findings.append(Located(index, finding))
        self.diagnosis.findings.sort(key=lambda item: (item.segment, item.finding.step))

    def _keep(self, findings: list[Finding]) -> None:
        if findings:
            assert self.segment is not None
            index = self.segment.index
            self.diagnosis.findings += [Located(index, finding) for finding in findings]


def diagnose(
    path: str,
    format: str = "auto",
    *,
    sinks: Sequence[RecordSink] = (),
    wrap: Callable[[Iterator[StepRecord]], Iterable[StepRecord]] | None = None,
    bins: int = 512,
) -> Diagnosis:
    """Read one log and run every record through the detectors (a fresh engine per segment).

    Args:
        path: A log file (plain or gzip), a run directory, or ``-`` for stdin.
        format: A reader name, or ``"auto"`` to detect it.
        sinks: Objects that get every record as it passes (see `RecordSink`).
        wrap: Wraps the record stream (a `LogStream`), for example in a progress bar.
        bins: Bins of the downsampled history kept for plots.

    Raises:
        LogReadError: The log cannot be read, or holds no step record at all.
    """
    notes: list[Note] = []
    records = read_log(path, format, notes=notes)
    found = records.format
    diagnosis = Diagnosis(path, found, notes, history=History(bins))
    run = _Run(diagnosis, sinks)
    try:
        for batch, visible in _batches(wrap(records) if wrap is not None else records, notes):
            run.observe_many(batch, visible)
    except LogReadError as exc:  # a reader gave up part-way: report what came before
        if run.segment is None:
            raise
        notes.append(Note("truncated", f"stopped reading: {exc}"))
    if run.segment is None:
        name = "standard input" if path == "-" else path
        raise LogReadError(f"{name}: no training steps found in this {found} log")
    run.finish()
    run.keep_live(records.findings)
    return diagnosis


_BATCH = 1024  # records handed on at a time
_STEP = attrgetter("step")


def _batches(
    records: Iterable[StepRecord], notes: list[Note]
) -> Iterator[tuple[list[StepRecord], int]]:
    """``records`` in lists of up to `_BATCH`, each with the number of notes left by the time
    its first record came; a record that came with a new note starts a list.

    A reader leaves a restart note just before the record that starts the new segment, so
    `_Run.observe_many` meets that note together with its record, first in a batch.
    """
    batch: list[StepRecord] = []
    append, noted, visible = batch.append, len(notes), len(notes)
    try:
        for record in records:
            if len(notes) != noted:
                if batch:
                    yield batch, visible
                    batch = []
                    append = batch.append
                noted = len(notes)
            if not batch:
                visible = noted
            append(record)
            if len(batch) == _BATCH:
                yield batch, visible
                batch = []
                append = batch.append
    except LogReadError:  # the reader gave up: what it read before still counts
        if batch:
            yield batch, visible
        raise
    if batch:
        yield batch, visible
