"""``LiveStep``: the state of the batch in flight, in one place.

Lightning hands the monitor a batch's pieces in separate hooks: the micro-batches
(``on_train_batch_start``), their losses (``on_before_backward``), one measurement per optimizer
step (``on_before_optimizer_step``: one per batch under automatic optimization, one per
``opt.step()`` under manual optimization, several optimizers included) and the end of the batch.
`LiveStep` keeps them until the batch's steps are done, so that the guard's judge, the root cause
and the reports read one state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from stabilizer.live.rootcause import RngState
from stabilizer.live.tensors import wide_dtype

from .measured import Measured

__all__ = ["LiveStep", "MicroBatch"]


@dataclass
class MicroBatch:
    """One ``training_step`` call of the step: its batch, random state and losses.

    Args:
        batch: The batch as Lightning handed it over (kept for a root-cause replay only).
        index: Its ``batch_idx``.
        rng: The torch random state before it (dropout masks), or None.
        losses: The losses it backpropagated (device tensors: read only on a failing step).
    """

    batch: Any
    index: int
    rng: RngState | None
    losses: list[torch.Tensor] = field(default_factory=list)


class LiveStep:
    """Micro-batches and measured optimizer steps of the batch in flight.

    Args:
        keep_batches: Keep the micro-batches themselves (for a root-cause replay).
    """

    def __init__(self, keep_batches: bool) -> None:
        self.keep_batches = keep_batches
        self.micro: list[MicroBatch] = []
        self.steps: list[Measured] = []  # measured in this batch, in order
        self._by_optimizer: dict[int, Measured] = {}  # measured, not stepped yet
        self._since_step: list[torch.Tensor] = []  # losses backpropagated since the last step
        self._last_loss: torch.Tensor | None = None  # the last step's, within this batch

    def begin(self, batch: Any, index: int, rng: RngState | None) -> bool:
        """A micro-batch starts; True when it is the first of an optimizer step."""
        first = not self.micro
        if first:
            self._last_loss = None
        kept = batch if self.keep_batches else None
        self.micro.append(MicroBatch(kept, index, rng if self.keep_batches else None))
        return first

    def add_loss(self, loss: torch.Tensor) -> None:
        """A backward is about to run on `loss` (divided by the accumulation, under it)."""
        loss = loss.detach().to(wide_dtype(loss.device))  # a finite 1e300 (64-true) stays finite
        self._since_step.append(loss)
        if self.micro:
            self.micro[-1].losses.append(loss)

    def step_loss(self) -> torch.Tensor | None:
        """The coming step's loss: the sum over the micro-batches since the last step; the last
        step's again when a second optimizer steps on the same backward; None without any."""
        if self._since_step:
            total = self._since_step[0]
            for loss in self._since_step[1:]:
                total = total + loss
            self._since_step, self._last_loss = [], total
            return total
        return self._last_loss

    def add(self, optimizer: torch.optim.Optimizer, step: Measured) -> None:
        self.steps.append(step)
        self._by_optimizer[id(optimizer)] = step

    def current(self, optimizer: torch.optim.Optimizer) -> Measured | None:
        """The measurement of this optimizer's coming step, if its hook ran."""
        return self._by_optimizer.get(id(optimizer))

    def end(self) -> list[Measured]:
        """The batch is done: its steps (none while accumulating)."""
        steps = self.steps
        if steps:
            self.steps, self.micro, self._by_optimizer = [], [], {}
        return steps
