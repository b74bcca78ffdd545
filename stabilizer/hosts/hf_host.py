"""`HFHost`: the Hugging Face ``Trainer`` as the step's host (`stabilizer.step.host.Host`).

A callback sees the Trainer through its events: the ``TrainingArguments``, the ``TrainerState``
and the model, optimizer, scheduler and dataloader they hand over. The optimizer the Trainer
steps is accelerate's ``AcceleratedOptimizer``; the guard goes on the torch optimizer inside it,
which accelerate's wrapper calls (through the fp16 grad scaler, which skips it on an overflow).
HF's own clipping (``max_grad_norm``, read at every step) is the host's clipping; a root cause
replays the model's recorded calls (`stabilizer.hosts.calls.ModelCalls`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stabilizer.step.host import HostFacts, MicroBatch

from .calls import ModelCalls
from .loop_host import inner_optimizer
from .ranks import Ranks

__all__ = ["HFHost", "hf_precision"]


def hf_precision(args: Any) -> str:
    """The ``TrainingArguments``' precision in Lightning's names."""
    if getattr(args, "fp16", False):
        return "16-mixed"
    return "bf16-mixed" if getattr(args, "bf16", False) else "32-true"


class HFHost:
    """A ``Trainer``'s training, as the step sees it.

    Args:
        args: The ``TrainingArguments``.
        state: The ``TrainerState`` (its ``global_step``).
        model: The model the Trainer trains (unwrapped: the callbacks' ``model``).
        optimizer: The optimizer the Trainer steps (accelerate's wrapper, or a torch one).
        scheduler: The LR scheduler, if any.
        data: The training dataloader, if handed over.
    """

    def __init__(
        self, args: Any, state: Any, model: nn.Module, optimizer: Any, scheduler: Any, data: Any
    ) -> None:
        self.args, self.state, self.model = args, state, model
        self.wrapper, self.optimizer = optimizer, inner_optimizer(optimizer)
        self.scheduler, self._data = scheduler, data  # (the dataloader)
        self.ranks = Ranks.current()
        self.scaler = getattr(optimizer, "scaler", None)  # accelerate's, under fp16
        self.calls: ModelCalls | None = None
        self.current = int(state.global_step)  # the step in flight (HF counts it up before
        self.should_stop = False  # its on_step_end, where the monitor reports it)
        self.saved = ""  # the last checkpoint the Trainer saved
        device = getattr(args, "device", torch.device("cpu"))
        self._facts = HostFacts(
            precision=hf_precision(args), accelerator=device.type, devices=1,
            strategy="hf_trainer", world_size=self.ranks.world_size, rank=self.ranks.rank,
            log_dir=Path(args.output_dir),
        )  # fmt: skip

    @property
    def facts(self) -> HostFacts:
        return self._facts

    @property
    def step(self) -> int:
        return self.current

    @property
    def module(self) -> nn.Module:
        return self.model

    @property
    def data(self) -> object | None:
        data: object | None = self._data
        return data

    @property
    def optimizers(self) -> Sequence[torch.optim.Optimizer]:
        return [self.optimizer]

    @property
    def schedulers(self) -> Sequence[Any]:
        return [self.scheduler] if self.scheduler is not None else []

    @property
    def loss_scale(self) -> torch.Tensor | float | None:
        if self.scaler is None or not self.scaler.is_enabled():
            return None
        scale = getattr(self.scaler, "_scale", None)  # a tensor: read without a sync
        return scale if scale is not None else float(self.scaler.get_scale())

    @property
    def clip(self) -> float | None:
        value = getattr(self.args, "max_grad_norm", None)
        return float(value) if value and math.isfinite(value) else None

    def set_clip(self, value: float) -> None:
        self.args.max_grad_norm = value  # the Trainer reads it at every step

    @property
    def warmup(self) -> int | None:
        group = self.optimizer.param_groups[0]
        peak = group.get("initial_lr")
        if self.scheduler is None or not peak:
            return 0 if self.scheduler is None else None
        return 0 if group["lr"] >= 0.5 * peak else 1

    @property
    def recount(self) -> bool:
        return False  # torch's version counters tell when code wrote the gradients since

    def reduce(self, vec: torch.Tensor, norms: int) -> torch.Tensor:
        return self.ranks.mean(vec)

    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        return self.ranks.sum(value)

    def gather(self, obj: Any) -> list[Any]:
        return self.ranks.gather(obj)

    def stop(self) -> None:
        self.should_stop = True  # the callback sets `control.should_training_stop`

    @property
    def checkpoint(self) -> str:
        return self.saved

    @property
    def replays_loss(self) -> bool:
        return False  # the model's calls: not a `compute_loss` of the user's around them

    def replay(self, micro: MicroBatch, loss_scale: float) -> Callable[[], torch.Tensor]:
        if self.calls is None:
            raise RuntimeError("the model's calls are not recorded")
        return self.calls.replay(micro.batch)

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        # The model is called without its DDP wrapper: no collective starts in the replay.
        yield

    def rewire(self) -> None:
        """Point accelerate's fp16 path at the optimizer's ``step`` as it is now (guarded, or
        no longer): accelerate keeps the one it found, to call inside ``scaler.step``."""
        wrapper = self.wrapper
        if self.scaler is None or not hasattr(wrapper, "_optimizer_original_step_method"):
            return
        from accelerate.optimizer import patch_optimizer_step

        wrapper._optimizer_original_step_method = self.optimizer.step
        wrapper._optimizer_patched_step_method = patch_optimizer_step(wrapper, self.optimizer.step)
