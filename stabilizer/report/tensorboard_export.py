"""A diagnosed log as TensorBoard events, so any trainer's text log can be browsed there.

While the log streams, every record is written as ``stability/<key>`` scalars at its step (as
the live monitor logs them, with the log10 of the per-layer norms and the steps skipped and
clipped so far); at the end come the
custom-scalars layout, the per-layer gradient norm heatmap (from the bounded history, when
per-layer norms were logged) and the findings table as text, one row per episode. Written with
`stabilizer.outputs.event_file.EventWriter`, one event file per input, opened once; no torch
needed.

The file's name ends in `REPLAY_SUFFIX`, so that a later ``stabilizer diagnose`` of a run
directory that holds the original run's event files too reads those and not this copy.
TensorBoard stores steps as int64 and scalars as float32: a record at a step outside int64 is
left out, a finite value beyond float32 becomes ±inf, and `TensorBoardExport.finish` says so.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from types import TracebackType

import numpy as np
from tensorboard.compat.proto.summary_pb2 import Summary

from stabilizer.core.records import Finding, StepRecord
from stabilizer.outputs.tensorboard import (
    FINDINGS_STEP,
    FINDINGS_TAG,
    HEATMAP_TAG,
    EventWriter,
    StepCounts,
    custom_scalars_layout,
    depth_order,
    findings_text,
    heatmap_summary,
    log10_norms,
    scalar_summary,
    table_rows,
)
from stabilizer.replay.diagnose import Diagnosis
from stabilizer.replay.readers import REPLAY_SUFFIX

from .advising import adviser
from .files import OutputError

__all__ = ["FINDINGS_TAG", "HEATMAP_TAG", "REPLAY_SUFFIX", "TensorBoardExport"]

_INT64 = 1 << 63
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _rows(diagnosis: Diagnosis) -> list[Finding]:
    """One row per episode, segment by segment (a restart's episodes are its own), advised as
    every output advises it."""
    segments: dict[int, list[Finding]] = {}
    for item in diagnosis.findings:
        segments.setdefault(item.segment, []).append(item.finding)
    advise = adviser(diagnosis)
    return [advise(i, row) for i in sorted(segments) for row in table_rows(segments[i])]


class TensorBoardExport:
    """Writes the records of one diagnosis, then its summaries, into one TensorBoard run.

    Use it as a `RecordSink` of `diagnose`, inside a ``with`` block, then call `finish` with
    the diagnosis. The event file is created with the first record, so a log that cannot be read
    leaves no file behind; leaving the block on an error removes the unfinished file.

    Args:
        logdir: The run directory; created when missing.
        replace: Once this export is complete, remove the earlier exports in ``logdir``
            (``--force``): the new one replaces them, it is not merged with them.
    """

    def __init__(self, logdir: Path, replace: bool = False) -> None:
        self.logdir, self.replace = logdir, replace
        self._opened: EventWriter | None = None  # opened with the first record: no empty file
        self._last: int | None = None  # last step written
        self._steps_out = 0  # records at steps TensorBoard cannot store
        self._values_out = 0  # finite values beyond float32
        self._counts = StepCounts()  # steps skipped and clipped so far

    def record(self, record: StepRecord) -> None:
        """Write one record's values as ``stability/<key>`` scalars at its step."""
        step, values = record.step, record.values
        if not -_INT64 <= step < _INT64:
            self._steps_out += 1
            return
        if values:
            self._values_out += sum(
                _FLOAT32_MAX < abs(value) < math.inf for value in values.values()
            )
            views = {**log10_norms(values), **self._counts.add(values)}
            self._write(scalar_summary({**values, **views}), step)
        self._last = step

    def finish(self, diagnosis: Diagnosis) -> list[str]:
        """Write the layout, the heatmap and the findings text; close the event file.

        Returns:
            Notes on what TensorBoard could not store as it was (one line each).
        """
        at = self._last or 0
        self._write(custom_scalars_layout(), 0)
        groups = depth_order(diagnosis.history.groups())
        if groups:
            _, rows = diagnosis.history.matrix(groups)
            self._write(heatmap_summary(np.asarray(rows, dtype=np.float64)), at)
        self._write(findings_text(_rows(diagnosis)), FINDINGS_STEP)
        self.close()
        if self.replace:
            self._remove_earlier()
        return self._notes()

    def _write(self, summary: Summary, step: int) -> None:
        try:
            if self._opened is None:
                self._opened = EventWriter(str(self.logdir), REPLAY_SUFFIX)
            self._opened.add_summary(summary, step)
        except OSError as exc:
            raise OutputError(f"{self.logdir}: cannot write ({exc.strerror or exc})") from None

    def _notes(self) -> list[str]:
        notes = []
        if self._steps_out:
            notes.append(
                f"note: {self._steps_out} records at steps outside TensorBoard's int64 range "
                f"are left out of {self.logdir}"
            )
        if self._values_out:
            notes.append(
                f"note: {self._values_out} values beyond float32's range (±3.4e38) are ±inf "
                f"in {self.logdir}"
            )
        return notes

    def _remove_earlier(self) -> None:
        """Remove the other exports of the run directory (this one replaces them)."""
        with os.scandir(self.logdir) as entries:
            for entry in entries:
                earlier = entry.name.endswith(REPLAY_SUFFIX) and "tfevents" in entry.name
                if earlier and entry.is_file(follow_symlinks=False):
                    with contextlib.suppress(FileNotFoundError):
                        if self._path != entry.path:
                            os.unlink(entry.path)

    @property
    def _path(self) -> str:
        return "" if self._opened is None else self._opened.path

    def close(self) -> None:
        """Flush and close the event file (if one was opened)."""
        if self._opened is not None:
            self._opened.close()

    def __enter__(self) -> TensorBoardExport:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
        if exc is not None and self._path:  # an unfinished export is no export
            with contextlib.suppress(OSError):
                os.unlink(self._path)
