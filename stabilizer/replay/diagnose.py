"""One log through the engine: `diagnose` streams the items of a reader into an `Engine`.

Records go straight from the reader to the engine; besides the findings only counters, a bounded
`History` and the notes are kept, so memory does not grow with the log. The run splits into
*segments* at the `Restart` items of the stream, and nowhere else; each segment gets a fresh
`Engine` (the resumed process started with fresh detector state too), so an episode never
straddles a restart. An episode's update replaces its entry in `Diagnosis.findings`: every
report lists it once, at the worst severity it reached. The stream's first `RunHeader` becomes
`Diagnosis.run`; of its `Finding`s (the monitor's own) those only the live run can know are kept.
The first `MAX_KEYS` distinct keys of a log are kept. Why: docs/readers.md.

One log may hold several runs (a script run twice with the same log dir appends to one
``stability.jsonl``): a `RunHeader` after records starts a segment (the monitor started again),
whose facts are that header's (`Segment.run`). A segment that starts again from the log's first
step is *a new run* (`Segment.new_run`), not a restart: nothing was resumed (neither a resume
banner nor ``auto``'s restart from a snapshot said so). The monitor's own findings stay in the
segment of the run that wrote them, wherever their steps fall.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

from stabilizer.core.engine import Engine, is_restart
from stabilizer.core.episode import Episodes
from stabilizer.core.kinds import LIVE_ONLY
from stabilizer.core.records import Finding, Severity, StepRecord
from stabilizer.core.run import RunHeader
from stabilizer.core.signals import GRAD_NORM, LOSS

from .document import STRUCTURED, document_kind, not_a_log
from .history import History
from .readers import Item, LogReadError, Note, Restart, read_log, unreadable_message

__all__ = [
    "MAX_FINDINGS",
    "MAX_KEYS",
    "Diagnosis",
    "Failure",
    "Located",
    "RecordSink",
    "Segment",
    "diagnose",
    "exit_code",
    "severity_counts",
]

MAX_KEYS = 4096
"""Distinct value keys kept per log; later new keys are dropped, with one note."""

MAX_FINDINGS = 10_000
"""The monitor's own findings of a ``stability.jsonl`` looked at: the first of the log."""


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
        nonfinite: Records whose loss is NaN or Inf, or 0 beside a NaN/Inf gradient norm (the
            HF Trainer's hidden NaN).
        nonfinite_since: First step of the non-finite losses the segment ends with, or None when
            its last loss is finite.
        run: The run's facts (its monitor's `RunHeader`), when the log has them.
        new_run: It starts a new run from the log's first step, no restart of the one before.
    """

    index: int
    first_step: int
    last_step: int
    records: int = 0
    why: str = ""
    line: int | None = None
    nonfinite: int = 0
    nonfinite_since: int | None = None
    run: RunHeader | None = None
    new_run: bool = False


LIVE_KINDS = LIVE_ONLY
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
    run: RunHeader | None = None

    @property
    def records(self) -> int:
        """Records read."""
        return sum(segment.records for segment in self.segments)

    @property
    def steps(self) -> tuple[int, int] | None:
        """The lowest and the highest step logged (None when nothing was read).

        Steps go on within a segment (a restart starts a new one), so these are the lowest first
        step and the highest last step of the segments.
        """
        if not self.segments:
            return None
        low = min(segment.first_step for segment in self.segments)
        return low, max(segment.last_step for segment in self.segments)

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


class _Diagnosing:
    """The state of one streaming diagnosis: the segment and engine of now, the keys seen."""

    def __init__(self, diagnosis: Diagnosis, sinks: Sequence[RecordSink]) -> None:
        self.diagnosis, self.sinks = diagnosis, sinks
        self.engine = Engine()
        self.segment: Segment | None = None
        self.restart: Restart | None = None  # the restart the next record starts a segment at
        self.keys: set[str] = set()  # the value keys kept (at most `MAX_KEYS`)
        self.episodes = Episodes()  # the segment's episodes
        self.base = 0  # where the segment's episodes begin in the findings
        # The monitor's own findings that no replay derives, each with its segment's index.
        self.stored: list[Located] = []
        self.seen = 0  # the monitor's own findings in the stream so far
        self.header: RunHeader | None = None  # the facts of the run of now
        self.started = False  # a header came after records: the monitor started again
        self.snapshot = False  # `auto` restarted from a snapshot since the last record
        # Told of each finding as the engine makes it, and whether it updates an episode
        # (`watch` alerts on both: a NaN that persists escalates its episode to critical).
        self.on_kept: Callable[[Located, bool], None] | None = None

    def observe(self, item: Item) -> None:
        """Take the next item of the stream: a record, a restart before the next one, the run's
        header (the first one is `Diagnosis.run`; one after records starts a segment), or one
        of the monitor's own findings (kept for `keep_live`)."""
        if not isinstance(item, StepRecord):  # (most items are records)
            self._other(item)
            return
        if self.segment is None or self.restart is not None or self.started:
            self._begin(item.step, self.restart)
            self.restart, self.started, self.snapshot = None, False, False
        record = item if self.keys.issuperset(item.values) else self._capped(item)
        segment = self.segment
        assert segment is not None
        _count(segment, record)
        self.diagnosis.history.add(record.step, segment.index, record.values)  # (`on_kept` reads)
        found = self.engine.observe(record)
        if found:  # (most records: none)
            self._keep(found)
        for sink in self.sinks:
            sink.record(record)

    def _other(self, item: Finding | RunHeader | Restart) -> None:
        """An item that is no record: one of the monitor's findings, the run's header, or a
        restart before the next record."""
        if isinstance(item, Finding):
            self._live(item)
        elif isinstance(item, RunHeader):
            self._header(item)
        elif self.segment is not None:  # (a restart before any record starts nothing)
            self.restart = item

    def _header(self, header: RunHeader) -> None:
        """The run's facts: the log's first run's, or those of a run that starts now."""
        if self.diagnosis.run is None:
            self.diagnosis.run = header
        self.header = header
        if self.segment is None:
            self.engine.set_run(header)  # (the detectors judge by what the run is)
        else:  # the monitor started again: a new run, or a resumed one (`_begin` tells)
            self.started = True

    def _live(self, finding: Finding) -> None:
        """One of the monitor's own findings: kept in the segment of the run that wrote it;
        after a restart from a snapshot, the engine's baselines start over, as the live
        engine's did."""
        if is_restart(finding):
            self.engine.restart()
            self.snapshot = True
        self.seen += 1
        if finding.kind in LIVE_KINDS and self.seen <= MAX_FINDINGS:
            index = self.segment.index if self.segment is not None else 1
            self.stored.append(Located(index + int(self.started), finding))

    def _capped(self, record: StepRecord) -> StepRecord:
        """``record`` without the new keys past the first `MAX_KEYS` of the log (noted once), for
        a record with keys not seen before."""
        new = [key for key in record.values if key not in self.keys]
        room = MAX_KEYS - len(self.keys)
        self.keys.update(new[:room])
        if len(new) <= room:
            return record
        if room > 0:  # the first record over the cap
            message = f"more than {MAX_KEYS} distinct keys: later new keys are dropped"
            self.diagnosis.notes.append(Note("skipped", message, None, record.step))
        return StepRecord(record.step, {k: v for k, v in record.values.items() if k in self.keys})

    def _begin(self, step: int, restart: Restart | None) -> None:
        segments = self.diagnosis.segments
        new_run = bool(segments) and step <= segments[0].first_step and not self.snapshot
        if restart is not None and restart.why.startswith("resume banner"):  # (`Segments`)
            new_run = False
        if self.segment is not None:
            self.finish()
            self.engine, self.episodes = Engine(), Episodes()
            if self.header is not None:
                self.engine.set_run(self.header)
            self.base = len(self.diagnosis.findings)
        index = len(segments) + 1
        if restart is None and self.started:
            restart = Restart(step, None, f"the monitor started again at step {step}")
        why, line = ("", None) if restart is None else (_why(restart, index, new_run), restart.line)
        self.segment = Segment(index, step, step, why=why, line=line, run=self.header)
        self.segment.new_run = new_run
        segments.append(self.segment)

    def finish(self) -> None:
        """End the segment of now: its detectors close their open episodes."""
        self._keep(self.engine.finish())

    def keep_live(self) -> None:
        """Keep the monitor's own findings of a ``stability.jsonl`` that no replay can derive
        (the root cause of a NaN, preflight, remedies applied), each in the segment of its step."""
        last = len(self.diagnosis.segments)
        for index, finding in self.stored:  # (a header with no record after it: the last)
            self.diagnosis.findings.append(Located(min(index, last), finding))
        self.diagnosis.findings.sort(key=lambda item: (item.segment, item.finding.step))

    def _keep(self, findings: list[Finding]) -> None:
        """Keep new findings; one that updates an episode of the segment replaces its entry."""
        kept = self.diagnosis.findings
        assert self.segment is not None
        for finding in findings:
            episode = self.episodes.add(finding)
            if episode.updates:
                kept[self.base + episode.index] = Located(self.segment.index, episode.finding)
            else:
                kept.append(Located(self.segment.index, finding))
            if self.on_kept is not None:
                self.on_kept(Located(self.segment.index, finding), episode.updates > 0)


def _why(restart: Restart, index: int, new_run: bool) -> str:
    """A segment's start as the reports show it: a new run, or a restart."""
    return f"{'a new run' if new_run else 'restart'}: {restart.why} (segment {index})"


def _count(segment: Segment, record: StepRecord) -> None:
    """Count ``record`` in ``segment``: records, last step, non-finite losses."""
    segment.records += 1
    segment.last_step = record.step
    loss = record.values.get(LOSS)
    if loss is None:
        return
    if math.isfinite(loss) and (loss != 0.0 or not _hidden_nan(loss, record.values.get(GRAD_NORM))):
        segment.nonfinite_since = None
        return
    segment.nonfinite += 1
    if segment.nonfinite_since is None:
        segment.nonfinite_since = record.step


def _hidden_nan(loss: float, grad_norm: float | None) -> bool:
    """Whether a loss of exactly 0 beside a NaN/Inf gradient norm is a NaN hidden: the HF
    Trainer's ``logging_nan_inf_filter`` logs 0 when every loss of the interval was NaN."""
    return loss == 0.0 and grad_norm is not None and not math.isfinite(grad_norm)


def diagnose(
    path: str,
    format: str = "auto",
    *,
    sinks: Sequence[RecordSink] = (),
    wrap: Callable[[Iterator[Item]], Iterable[Item]] | None = None,
    bins: int = 512,
) -> Diagnosis:
    """Read one log and run every record through the detectors (a fresh engine per segment).

    Args:
        path: A log file (plain or gzip), a run directory, or ``-`` for stdin.
        format: A reader name, or ``"auto"`` to detect it.
        sinks: Objects that get every record as it passes (see `RecordSink`).
        wrap: Wraps the item stream (a `LogStream`), for example in a progress bar.
        bins: Bins of the downsampled history kept for plots.

    Raises:
        LogReadError: The log cannot be read, holds no step record at all, or is a document
            (markdown, source code: `document_kind`) rather than a log.
    """
    notes: list[Note] = []
    stream = read_log(path, format, notes=notes)
    kind = None if stream.format in STRUCTURED else document_kind(stream.head_lines())
    if kind is not None:  # a README or a script: whatever lines of it quote a log
        stream.close()
        raise LogReadError(not_a_log(path, kind))
    diagnosis = Diagnosis(path, stream.format, notes, history=History(bins))
    replay = _Diagnosing(diagnosis, sinks)
    try:
        for item in wrap(stream) if wrap is not None else stream:
            replay.observe(item)
    except LogReadError as exc:  # a reader gave up part-way: report what came before
        if replay.segment is None:
            raise
        notes.append(Note("truncated", f"stopped reading: {exc}"))
    if replay.segment is None:
        name = "standard input" if path == "-" else path
        message = unreadable_message(name, stream.head_lines(), stream.format)
        if format == "auto" and stream.format in _CONSOLE and Path(path).is_file():
            return _as_generic(path, stream.format, message, sinks=sinks, wrap=wrap, bins=bins)
        raise LogReadError(message)
    replay.finish()
    replay.keep_live()
    return diagnosis


_CONSOLE = frozenset(("hf_trainer", "deepspeed", "megatron", "fairseq"))
"""Console formats a dedicated reader reads by their head: where it finds no step, the universal
reader reads the log before it is called unreadable (a head can mislead: an HF Trainer's banner
above a script's own tqdm lines)."""


def _as_generic(
    path: str,
    sniffed: str,
    why: str,
    *,
    sinks: Sequence[RecordSink],
    wrap: Callable[[Iterator[Item]], Iterable[Item]] | None,
    bins: int,
) -> Diagnosis:
    """`diagnose` of ``path`` by the universal reader, after the reader of the format its head
    looked like (``sniffed``) found no step (``why``, its error, is raised again where the
    universal reader finds none either)."""
    try:
        diagnosis = diagnose(path, "generic", sinks=sinks, wrap=wrap, bins=bins)
    except LogReadError:
        raise LogReadError(why) from None
    said = f"its head looked like a {sniffed} log, whose reader found no step: read as generic"
    diagnosis.notes.insert(0, Note("format", said))
    return diagnosis
