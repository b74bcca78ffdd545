"""`ScalarLogger`: a TensorBoard ``SummaryWriter`` as a logger of the monitor's records.

Lightning's ``TensorBoardLogger`` writes each record's values as scalars under ``stability/``;
a plain loop or the Hugging Face ``Trainer`` hands the monitor a ``SummaryWriter`` instead, and
this writes the same scalars with it (the monitor's TensorBoard extras use the writer itself).
"""

from __future__ import annotations

from typing import Any

__all__ = ["ScalarLogger"]


class ScalarLogger:
    """Writes metrics by step with ``writer.add_scalar``.

    Args:
        writer: ``torch.utils.tensorboard.SummaryWriter`` (or one that writes alike).
    """

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
