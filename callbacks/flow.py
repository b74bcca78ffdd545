"""`StepFlow`: what each of Lightning's hooks of a training batch does with the monitor's parts.

In hook order: the batch starts (the protection notes its micro-batch and buffers, the preflight
runs once, activations are sampled), each backward hands over its loss, each optimizer step is
measured (its numbers go to the host without waiting) and handed to the guard, which decides
inside the step; at the batch end the protection checks and counts, and the steps are reported.
The monitor's own forwards (a root-cause replay, the preflight) run `quiet`: the hooks ignore
them. `StabilityMonitor` builds the parts and calls these from its hooks; the fit's start and
end are here too.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch

from stabilizer.core.records import Finding

from .auto import AutoRemedies
from .checks import Preflight
from .cost import CostMeter
from .live_step import LiveStep
from .measure import Measurer, Probes
from .protection import Protection
from .reporting import Reporter

__all__ = ["StepFlow"]

log = logging.getLogger("stabilizer")


class StepFlow:
    """The monitor's work in each hook of a training batch.

    Args:
        live: The batch in flight.
        measure: Measures each optimizer step.
        reporter: Reports the measured steps.
        cost: The monitor's cost meter.
        preflight: The checks of the first batch.
        protection: The protection (policies ``protect`` and ``auto``), or None.
        auto: The remedies (policy ``auto``), or None.
        activation_every: Sample activations every N steps (0: never).
    """

    def __init__(
        self,
        live: LiveStep,
        measure: Measurer,
        reporter: Reporter,
        cost: CostMeter,
        preflight: Preflight,
        protection: Protection | None,
        auto: AutoRemedies | None,
        activation_every: int,
    ) -> None:
        self.live, self.measure, self.reporter, self.cost = live, measure, reporter, cost
        self.preflight, self.protection, self.auto = preflight, protection, auto
        self.activation_every = activation_every
        self.inert = False  # the monitor's own replay or preflight is running
        self._extra: list[Finding] = []  # the preflight's findings, reported with the first step

    def fit_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        monitor: pl.Callback,
        grouping: Callable[[str], str] | None,
    ) -> None:
        """The protection, the remedies and the probes start. An error leaves the run without
        probes: every step is unmeasured, and ``protect`` skips them all, loudly."""
        try:
            if self.protection is not None:
                self.protection.start(trainer, pl_module, monitor)
            if self.auto is not None:
                self.auto.start(trainer, pl_module)
            acts = bool(self.activation_every)
            self.measure.probes = Probes(pl_module, trainer.optimizers, grouping, acts)
        except Exception as e:
            if self.measure.strict:
                raise
            log.error("StabilityMonitor could not start: %r", e, exc_info=True)

    def release(self) -> None:
        """The run is over: the optimizers unguarded, the remedies' hooks removed."""
        if self.protection is not None:
            self.protection.guard.uninstall()
        if self.auto is not None:
            self.auto.stop()

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """The monitor's own forwards (replay, preflight): the hooks ignore them."""
        self.inert = True
        try:
            yield
        finally:
            self.inert = False

    def batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int
    ) -> None:
        self.cost.batch_start(trainer.global_step)
        with self.cost.part("measure"):
            prot = self.protection
            if prot is not None:
                prot.begin_batch(trainer, batch, i)
            else:
                self.live.begin(batch, i, None)  # the micro-batches' losses, nothing kept
            guard = prot.guard if prot is not None else None
            self._extra += self.preflight(trainer, pl_module, batch, self.quiet, guard)
            if self.measure.probes is not None:
                self.measure.probes.sample(trainer.global_step, self.activation_every)

    def before_backward(self, loss: torch.Tensor) -> None:
        # Under gradient accumulation Lightning hands over loss / accumulate_grad_batches for each
        # micro-batch: their sum is the step's mean loss.
        if not self.inert:
            with self.cost.part("measure"):
                self.live.add_loss(loss)

    def before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        prot = self.protection
        if self.inert or (prot is not None and prot.evaluating_again(optimizer)):
            return
        with self.cost.part("measure"):  # the numbers go to the host without waiting
            loss, weights = self.live.step_loss(), prot.weights_check if prot else None
            step = self.measure(trainer, optimizer, loss, weights)
        self.reporter.pending(trainer, pl_module)  # the last step's, while the device works
        # As the step will use it: after the remedies so far.
        factor = self.auto.lr.factor if self.auto is not None else 1.0
        step.note(trainer, optimizer, factor, prot is not None)
        step.found, self._extra = self._extra, []
        step.optimizer_index = next(
            (i for i, opt in enumerate(trainer.optimizers) if opt is optimizer), 0
        )
        self.live.add(optimizer, step)
        if prot is not None:
            with self.cost.part("guard"):
                prot.measured(optimizer, step)  # the guard decides inside the step

    def batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.measure.probes is not None:
            self.cost.add("activations", self.measure.probes.take_seconds())
        steps = self.live.end()
        if steps and self.protection is not None:
            with self.cost.part("guard"):
                self.protection.end_batch(trainer, steps)
        self.reporter.steps(trainer, pl_module, steps)
        self.cost.batch_end(trainer.global_step)

    def train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The last step's report, the last check of the weights, the run's end."""
        reporter, prot = self.reporter, self.protection
        reporter.pending(trainer, pl_module)
        if prot is not None:
            found = prot.finish(trainer, pl_module)
            if found:
                reporter.safely(reporter.emit, trainer, None, found)
        skipped = prot.skipped_steps if prot is not None else 0
        reporter.safely(reporter.finish, trainer, skipped, prot.intact if prot else None)
