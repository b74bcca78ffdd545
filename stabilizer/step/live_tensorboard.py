"""TensorBoard extras of the monitor: the layout, log10 norms, the heatmap, the findings table."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from stabilizer.core.records import Finding, StepRecord
from stabilizer.core.run import RunEnd
from stabilizer.core.signals import GRAD_NORM_PREFIX
from stabilizer.outputs.heatmap import fallback_description, labelled_heatmap_png, warm_up
from stabilizer.outputs.tensorboard import (
    FINDINGS_STEP,
    HEATMAP_DESCRIPTION,
    HEATMAP_TAG,
    FindingsTable,
    StepCounts,
    custom_scalars_layout,
    depth_order,
    findings_text,
    heatmap_png,
    image_summary,
    log10_norms,
    scalar_summary,
)

__all__ = ["TensorBoardOutput"]


class TensorBoardOutput:
    """Writes what plain scalars cannot show into a run's TensorBoard event file.

    At the loggers' cadence, the log10 of the per-layer gradient norms (the monitor's logger
    writes the norms themselves) and the steps skipped and clipped so far; every record, a
    column of the heatmap; whenever an episode
    opens, grows or ends, the findings table, one row per episode, written whole at
    `FINDINGS_STEP` so that TensorBoard keeps the newest alone.

    Args:
        writer: ``torch.utils.tensorboard.SummaryWriter`` (``TensorBoardLogger.experiment``).
        groups: The depth groups whose gradient norms are logged.
        every: Steps between heatmaps (0: only at the end).
        earlier: The findings of the run before a resume: the table lists them too (a resumed
            run that writes into the same TensorBoard run replaces the entry).
        log_every: Write the log10 norms every N steps (``trainer.log_every_n_steps``, the
            cadence of the norms themselves in the loggers); the heatmap has every step.
        window: Steps shown in the heatmap (the most recent ones).
    """

    name = "tensorboard"
    quiet = True

    def __init__(
        self,
        writer: Any,
        groups: list[str],
        every: int = 100,
        earlier: Sequence[Finding] = (),
        log_every: int = 1,
        window: int = 500,
    ) -> None:
        self._file, self.every, self.log_every = writer._get_file_writer(), every, max(1, log_every)
        self._groups: list[str] | None = groups  # the layout is written with the first record
        self._keys = [
            GRAD_NORM_PREFIX + g for g in depth_order(groups)
        ]  # heatmap rows, input first
        self._steps: deque[int] = deque(maxlen=window)
        # A layer without a gradient at a step (None) shows its last value; one that had none in
        # the window is no row (no gradient is not a zero gradient).
        self._rows: deque[list[float | None]] = deque(maxlen=window)
        self._last: dict[str, float] = {}
        self._episodes = FindingsTable()
        self._counts = StepCounts()  # steps skipped and clipped so far
        for finding in earlier:
            self._episodes.add([finding])
        self._step = 0  # the last record's step: what the findings table is "as of"
        warm_up()  # at fit start, not at the first heatmap's step

    def write(self, record: StepRecord | None, found: Sequence[Finding]) -> None:
        """Log the step's log10 norms, the heatmap every `every` steps, the table if it changed.

        Args:
            record: The step's record; None for findings alone.
            found: The findings reported with it, one batch (see `FindingsTable.add`).
        """
        every = self.every
        if record is not None and self._groups is not None:
            # Only now are the logged keys known: no loss-scale chart without a grad scaler.
            self._file.add_summary(custom_scalars_layout(self._groups, record.values), 0)
            self._groups = None
        if record is not None:
            self._step = record.step
        if record is not None:
            counts = self._counts.add(record.values)
            if (record.step + 1) % self.log_every == 0 and (counts or self._keys):
                logged = {**log10_norms(record.values), **counts}
                self._file.add_summary(scalar_summary(logged), record.step)
        if record is not None and self._keys:
            self._steps.append(record.step)
            self._last.update((k, record.values[k]) for k in self._keys if k in record.values)
            self._rows.append([self._last.get(k) for k in self._keys])
            if every and record.step > 0 and record.step % every == 0:
                self._heatmap(record.step)
        if self._episodes.add(found):
            self._table(self._step)

    def close(self, end: RunEnd) -> None:
        """Write the final heatmap and findings table (as of the last step), and flush."""
        step = end.step
        if self._rows:
            self._heatmap(step)
        self._table(step)
        self._file.flush()

    def _table(self, as_of: int) -> None:
        self._file.add_summary(findings_text(self._episodes.rows, as_of), FINDINGS_STEP)

    def _heatmap(self, step: int) -> None:
        groups, rows = [], []
        for key, cells in zip(self._keys, zip(*self._rows, strict=True), strict=True):
            first = next((cell for cell in cells if cell is not None), None)
            if first is not None:  # (leading gaps: the first value)
                groups.append(key[len(GRAD_NORM_PREFIX) :])
                rows.append([first if cell is None else cell for cell in cells])
        if not rows:
            return
        matrix, steps = np.asarray(rows, dtype=np.float64), list(self._steps)  # (layers, steps)
        png = labelled_heatmap_png(steps, groups, matrix)
        if png is None:  # no matplotlib: the pixel image, its labels in the description
            summary = image_summary(
                HEATMAP_TAG, heatmap_png(matrix), description=fallback_description(
                    steps, groups, matrix)
            )  # fmt: skip
        else:
            summary = image_summary(HEATMAP_TAG, png, description=HEATMAP_DESCRIPTION)
        self._file.add_summary(summary, step)
