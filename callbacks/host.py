"""`LightningHost`: Lightning's ``Trainer`` as the step's host (`stabilizer.step.host.Host`).

Everything the step reads of a training comes from the Trainer here: the global step, the
optimizers and schedulers, the precision plugin's grad scaler, ``gradient_clip_val``, the
strategy's reductions, ``should_stop``, the checkpoint callback's last path. A root-cause replay
runs the LightningModule's ``training_step`` again on the kept batch, with stand-ins for its
optimizers and schedulers, ``manual_backward`` only backpropagating and ``self.log`` silent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from stabilizer.live.probes import GradProbe
from stabilizer.step.host import HostFacts, MicroBatch

__all__ = ["LightningHost", "user_code_after"]


class LightningHost:
    """A Lightning fit, as the step sees it.

    Args:
        trainer: The Trainer.
        module: The LightningModule it fits.
        me: The monitor's callback (code in the callbacks after it may touch the gradients).
    """

    def __init__(self, trainer: pl.Trainer, module: pl.LightningModule, me: pl.Callback) -> None:
        self.trainer, self._module = trainer, module
        self._recount = user_code_after(trainer, module, me)
        # `trainer.log_dir` is a broadcast under DDP: every rank asks now, or rank 0 waits.
        log_dir = trainer.log_dir if trainer.loggers else None
        accelerator = type(trainer.accelerator).__name__.removesuffix("Accelerator").lower()
        self._facts = HostFacts(
            precision=str(trainer.precision), accelerator=accelerator,
            devices=max(1, int(trainer.num_devices)), strategy=type(trainer.strategy).__name__,
            world_size=max(1, int(trainer.world_size)), rank=int(trainer.global_rank),
            log_dir=Path(log_dir) if log_dir else None, root_dir=Path(trainer.default_root_dir),
        )  # fmt: skip

    @property
    def facts(self) -> HostFacts:
        return self._facts

    @property
    def step(self) -> int:
        return int(self.trainer.global_step)

    @property
    def module(self) -> pl.LightningModule:
        return self._module

    @property
    def data(self) -> object | None:
        # A new object when Lightning loads the dataloaders again (a new stage, a
        # `reload_dataloaders_every_n_epochs`).
        return self.trainer.train_dataloader

    @property
    def optimizers(self) -> Sequence[torch.optim.Optimizer]:
        return self.trainer.optimizers

    @property
    def schedulers(self) -> Sequence[Any]:
        return [config.scheduler for config in self.trainer.lr_scheduler_configs]

    @property
    def loss_scale(self) -> torch.Tensor | float | None:
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is None:
            return None
        scale = getattr(scaler, "_scale", None)
        return scale if scale is not None else 1.0

    @property
    def clip(self) -> float | None:
        value = self.trainer.gradient_clip_val
        return float(value) if value else None

    def set_clip(self, value: float) -> None:
        # Lightning reads `gradient_clip_val` every step.
        self.trainer.gradient_clip_val = value

    @property
    def warmup(self) -> int | None:
        trainer = self.trainer
        if not trainer.lr_scheduler_configs or not trainer.optimizers:
            return 0  # a constant LR has no warmup
        group = trainer.optimizers[0].param_groups[0]
        peak = group.get("initial_lr")
        if peak is None or not peak:
            return None
        return 0 if group["lr"] >= 0.5 * peak else 1

    @property
    def recount(self) -> bool:
        return self._recount

    def reduce(self, vec: torch.Tensor, norms: int) -> torch.Tensor:
        """Mean over ranks; a NaN anywhere makes it NaN everywhere, so all ranks decide alike.

        Sharded parameters (FSDP): each rank holds a shard of every gradient, so the norms are
        partial: their squares are summed over ranks (then the square root), the rest averaged.
        """
        strategy = self.trainer.strategy
        if not isinstance(strategy, FSDPStrategy | ModelParallelStrategy):
            return cast(torch.Tensor, strategy.reduce(vec, reduce_op="mean"))
        squares = strategy.reduce(GradProbe.sharded_squares(vec[:norms]), reduce_op="sum")
        rest = strategy.reduce(vec[norms:], reduce_op="mean")
        return torch.cat((GradProbe.from_squares(squares), rest))

    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.trainer.strategy.reduce(value, reduce_op="sum"))

    def gather(self, obj: Any) -> list[Any]:
        if self._facts.world_size <= 1 or not torch.distributed.is_initialized():
            return [obj]
        # Our own processes' objects, pickled by torch.distributed (never a log's).
        gathered: list[Any] = [None] * self._facts.world_size
        torch.distributed.all_gather_object(gathered, obj)
        return gathered

    def stop(self) -> None:
        self.trainer.should_stop = True

    @property
    def checkpoint(self) -> str:
        ckpt = self.trainer.checkpoint_callback
        return getattr(ckpt, "last_model_path", "") or getattr(ckpt, "best_model_path", "")

    @property
    def replays_loss(self) -> bool:
        return True  # the training step again: the loss as the step computed it

    def replay(self, micro: MicroBatch, loss_scale: float) -> Callable[[], torch.Tensor]:
        """The micro-batch's training step again. Under manual optimization the step
        backpropagates itself (its loss comes back detached)."""
        trainer, module = self.trainer, self._module

        def run_step() -> torch.Tensor:
            backwarded: list[torch.Tensor] = []

            def manual_backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
                backwarded.append(loss)
                torch.autograd.backward(loss * loss_scale, *args, **kwargs)

            module.manual_backward = manual_backward  # type: ignore[method-assign]
            with trainer.precision_plugin.train_step_context():
                out = module.training_step(micro.batch, micro.index)
            if backwarded:
                return backwarded[-1].detach()
            loss = out["loss"] if isinstance(out, dict) else out
            if not isinstance(loss, torch.Tensor):
                raise TypeError(f"training_step returned {type(out).__name__}, not a loss")
            return loss

        return run_step

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """No optimizer or scheduler steps, nothing logged; under DDP the replay's backward does
        not all-reduce (the other ranks are not replaying in step). The stand-ins are instance
        attributes, which the step's sandbox undoes."""
        module = self._module
        no_sync = getattr(self.trainer.strategy.model, "no_sync", contextlib.nullcontext)
        optimizers = _inert(module.optimizers(use_pl_optimizer=False))
        schedulers = module.lr_schedulers()
        with no_sync():
            module.optimizers = lambda use_pl_optimizer=True: optimizers  # type: ignore[method-assign]
            module.lr_schedulers = lambda: _inert(schedulers)  # type: ignore[method-assign]
            module.log = module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign,assignment]
            yield


def user_code_after(trainer: pl.Trainer, pl_module: pl.LightningModule, me: pl.Callback) -> bool:
    """Whether code other than Lightning's own clipping runs between the monitor's
    ``on_before_optimizer_step`` and the optimizer step: a later callback's hook, the module's
    ``on_before_optimizer_step`` or ``configure_gradient_clipping``."""
    callbacks = list(getattr(trainer, "callbacks", []))
    later = callbacks[callbacks.index(me) + 1 :] if me in callbacks else []
    hook = pl.Callback.on_before_optimizer_step
    if any(type(cb).on_before_optimizer_step is not hook for cb in later):
        return True
    base = pl.LightningModule
    return (
        type(pl_module).on_before_optimizer_step is not base.on_before_optimizer_step
        or type(pl_module).configure_gradient_clipping is not base.configure_gradient_clipping
    )


class _Inert:
    """An optimizer or scheduler whose ``step`` and ``zero_grad`` do nothing; the rest is the
    real one's (param groups, state)."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _inert(objs: Any) -> Any:
    if objs is None:
        return None
    if isinstance(objs, list | tuple):
        return [_Inert(o) for o in objs]
    return _Inert(objs)
