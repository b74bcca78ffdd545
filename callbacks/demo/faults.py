"""``FaultInjector``: the deterministic faults of the failure scenarios, applied to a real run."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from stabilizer.demo.scenarios import ActivationFault

__all__ = ["FaultInjector"]


class FaultInjector(pl.Callback):
    """Inject an LR surge and/or an activation overflow at known optimizer steps.

    Corrupted batches are not injected here: they come from the data (see
    ``StabilizerDataModule(corrupt=...)``), as bad data does.

    Args:
        lr_surge: ``(step, factor)``: from ``step`` on, every param group's LR is multiplied by
            ``factor`` (on top of the scheduler, which rewrites the LR each step).
        lr_surge_until: The surge ends before this step (None: it never ends).
        activation_fault: Multiplies a module's output on a window of training steps.
    """

    def __init__(
        self,
        lr_surge: tuple[int, float] | None = None,
        activation_fault: ActivationFault | None = None,
        lr_surge_until: int | None = None,
    ) -> None:
        self.lr_surge, self.lr_surge_until = lr_surge, lr_surge_until
        self.activation_fault = activation_fault
        self._handle: torch.utils.hooks.RemovableHandle | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.activation_fault is not None:
            fault = self.activation_fault
            target = _find(pl_module, fault.module)
            self._handle = target.register_forward_hook(
                lambda mod, args, out: self._amplify(trainer, mod, out, fault)
            )

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # The scheduler set this step's LR at the end of the previous step; surge on top of it.
        surge, step, until = self.lr_surge, trainer.global_step, self.lr_surge_until
        if surge is not None and surge[0] <= step and (until is None or step < until):
            for optimizer in trainer.optimizers:
                for group in optimizer.param_groups:
                    group["lr"] *= surge[1]

    @staticmethod
    def _amplify(
        trainer: pl.Trainer, module: nn.Module, out: torch.Tensor, fault: ActivationFault
    ) -> torch.Tensor | None:
        if module.training and fault.start <= trainer.global_step < fault.stop:
            return out * fault.gain
        return None


def _find(pl_module: pl.LightningModule, name: str) -> nn.Module:
    # Scenario module names are relative to the GPT; accept them on the LightningModule too.
    for prefix in ("model.", ""):
        try:
            return pl_module.get_submodule(prefix + name)
        except AttributeError:
            continue
    raise ValueError(f"activation fault target {name!r} is not a submodule of the model")
