"""A diagnosed log as TensorBoard events, so any trainer's text log can be browsed there.

While the log streams, every record is written as ``stability/<key>`` scalars at its step (as
the live monitor logs them); at the end come the custom-scalars layout, the per-layer gradient
norm heatmap (from the bounded history, when per-layer norms were logged) and the findings table
as text. Written with `stabilizer.outputs.tensorboard.EventWriter`: no torch needed.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType

import numpy as np

from stabilizer.core.records import StepRecord
from stabilizer.outputs.tensorboard import (
    FINDINGS_TAG,
    HEATMAP_TAG,
    EventWriter,
    custom_scalars_layout,
    depth_order,
    findings_text,
    heatmap_summary,
    scalar_summary,
)
from stabilizer.replay.diagnose import Diagnosis

__all__ = ["FINDINGS_TAG", "HEATMAP_TAG", "TensorBoardExport"]


class TensorBoardExport:
    """Writes the records of one diagnosis, then its summaries, into one TensorBoard run.

    Use it as a `RecordSink` of `diagnose`, then call `finish` with the diagnosis; or `close`
    it (also as a context manager) to stop without the summaries. The event file is created with
    the first record, so a log that cannot be read leaves no file behind.

    Args:
        logdir: The run directory; created when missing.
    """

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self._opened: EventWriter | None = None  # opened with the first record: no empty file
        self._last = 0  # last step written

    @property
    def _writer(self) -> EventWriter:
        if self._opened is None:
            self._opened = EventWriter(str(self.logdir))
        return self._opened

    def record(self, record: StepRecord) -> None:
        """Write one record's values as ``stability/<key>`` scalars at its step."""
        if record.values:
            self._writer.add_summary(scalar_summary(record.values), record.step)
        self._last = record.step

    def finish(self, diagnosis: Diagnosis) -> None:
        """Write the layout, the heatmap and the findings text; close the event file."""
        try:
            self._writer.add_summary(custom_scalars_layout(), 0)
            groups = depth_order(diagnosis.history.groups())
            if groups:
                _, rows = diagnosis.history.matrix(groups)
                matrix = np.asarray(rows, dtype=np.float64)
                self._writer.add_summary(heatmap_summary(matrix), self._last)
            findings = [item.finding for item in diagnosis.findings]
            self._writer.add_summary(findings_text(findings), self._last)
        finally:
            self.close()

    def close(self) -> None:
        """Flush and close the event file (if one was opened)."""
        if self._opened is not None:
            self._opened.close()
            self._opened = None

    def __enter__(self) -> TensorBoardExport:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
