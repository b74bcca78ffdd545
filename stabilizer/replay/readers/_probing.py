"""The fp16 loss scaler's start-up probing, in logs that do not show the scaler (the HF Trainer).

A dynamic loss scaler starts high (torch 2^16, DeepSpeed up to 2^32) and halves its scale at each
overflow, skipping that step, until the gradients fit fp16: the first steps of an fp16 run may
have non-finite gradients while the loss is finite. Console logs of DeepSpeed or apex print those
overflows (read as skipped steps with their scale, which `Fp16Overflow` knows as calibration);
the HF Trainer's log dicts and ``trainer_state.json`` only show ``grad_norm: NaN``. `Probing`
holds the first records back while they look like that, and when the gradient norm comes back
finite within the first `STEPS` steps, hands them out as skipped steps without the NaN norm (a
note says so), as the console readers do; otherwise as they were.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from stabilizer.core.records import StepRecord
from stabilizer.core.signals import GRAD_NORM, LOSS, SKIPPED

from .base import BaseReader

__all__ = ["STEPS", "Probing"]

STEPS = 32
"""Steps of a run's start in which probing may go on: from 2^32 a scaler halves to 1 in 32."""

_EPOCH = "epoch"  # the epoch a record says it is in (HF log dicts; passed through as printed)


class Probing:
    """Takes a reader's records in order; hands them out, the start-up probing made plain.

    Args:
        reader: The reader whose notes say what was read as probing.
    """

    def __init__(self, reader: BaseReader) -> None:
        self.reader = reader
        self.held: list[StepRecord] = []
        self.open = True  # still at the start of the log

    def take(self, record: StepRecord) -> list[StepRecord]:
        """The records ready to go out now, ``record`` included or held back."""
        if not self.open:
            return [record]
        values = record.values
        grad, loss = values.get(GRAD_NORM), values.get(LOSS)
        if grad is None and self.held:  # (an eval record: it waits with the others)
            self.held.append(record)
            return []
        first = not self.held and values.get(_EPOCH, 0.0) < 0.1  # (HF dicts: epoch 0.53 is late)
        if (first or self.held) and _overflowed(record.step, grad, loss):
            self.held.append(record)
            return []
        if self.held and grad is not None and math.isfinite(grad):
            return self._probed(record)
        return [*self.flush(), record]

    def flush(self) -> list[StepRecord]:
        """The records held back, as they were (no probing seen to end); the start is over."""
        held, self.held, self.open = self.held, [], False
        return held

    def _probed(self, record: StepRecord) -> list[StepRecord]:
        """The probing ended at ``record``: the held records as skipped steps, without the NaN
        gradient norm."""
        steps = [r.step for r in self.held if GRAD_NORM in r.values]
        message = (
            f"grad_norm non-finite at steps {steps[0]}-{steps[-1]}, the first of the run, while "
            f"the loss is finite, and finite from step {record.step} on: the fp16 loss scaler's "
            "start-up probing (it halves its scale at each overflow and skips that step); read "
            "as skipped steps"
        )
        self.reader.note("format", message, step=steps[0])
        out = [
            StepRecord(r.step, {**_without_norm(r.values), SKIPPED: 1.0})
            if GRAD_NORM in r.values
            else r
            for r in self.held
        ]
        self.flush()
        return [*out, record]


def _overflowed(step: int, grad: float | None, loss: float | None) -> bool:
    """Whether a record looks like a probing overflow: a non-finite gradient norm beside a
    finite loss, within the first `STEPS` steps."""
    return (
        grad is not None
        and not math.isfinite(grad)
        and loss is not None
        and math.isfinite(loss)
        and step <= STEPS
    )


def _without_norm(values: Mapping[str, float]) -> dict[str, float]:
    return {key: value for key, value in values.items() if key != GRAD_NORM}
