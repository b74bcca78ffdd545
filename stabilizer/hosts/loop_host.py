"""`LoopHost`: a plain PyTorch loop (or Fabric's) as the step's host (`stabilizer.step.host.Host`).

What Lightning's Trainer tells the step, a plain loop tells through `stabilizer.hosts.loop.
Stabilizer`: the step number is the count of its ``with stab.step()`` blocks that stepped, the
optimizers and schedulers are the ones it was given, the fp16 scaler is the loop's, the ranks
are ``torch.distributed``'s. A root cause replays the model's recorded calls
(`stabilizer.hosts.calls.ModelCalls`): not the loop's own code around them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stabilizer.step.host import HostFacts, MicroBatch

from .calls import ModelCalls, unwrap
from .ranks import Ranks

__all__ = ["LoopHost", "inner_optimizer", "loop_facts"]


class LoopHost:
    """A plain loop as the step sees it.

    Args:
        model: The model the loop calls (a wrapper: DDP, Fabric's, compiled; or the model).
        optimizers: The optimizers that step (unwrapped: Fabric's and accelerate's wrappers
            call these).
        schedulers: The LR schedulers (a remedy's new parameter group joins them).
        scaler: An fp16 ``torch.amp.GradScaler``, if the loop uses one.
        facts: The run's facts.
        clip: Clip the gradient norm at this value inside each optimizer step, after the step
            is measured (Lightning's ``gradient_clip_val``); None: the host does not clip.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        schedulers: Sequence[Any],
        scaler: Any,
        facts: HostFacts,
        clip: float | None = None,
    ) -> None:
        self.model, self._module = model, unwrap(model)
        self._optimizers, self._schedulers = list(optimizers), list(schedulers)
        self.scaler, self._facts, self._clip = scaler, facts, clip
        self.ranks = Ranks(facts.world_size, facts.rank)
        self.calls: ModelCalls | None = None  # the model's calls, for a replay
        self.done = 0  # steps done: the blocks whose optimizers stepped
        self.should_stop = False
        self.early = False  # this step was measured before `optimizer.step` (`before_step`)
        # Called first inside each optimizer step (a policy without a guard measures there).
        self.at_step: Callable[[torch.optim.Optimizer], None] | None = None
        self._hooks = [opt.register_step_pre_hook(self._stepping) for opt in self._optimizers]

    @property
    def facts(self) -> HostFacts:
        return self._facts

    @property
    def step(self) -> int:
        return self.done

    @property
    def module(self) -> nn.Module:
        return self._module

    @property
    def data(self) -> object | None:
        return None  # a plain loop does not say (a level change is then told by the loss)

    @property
    def optimizers(self) -> Sequence[torch.optim.Optimizer]:
        return self._optimizers

    @property
    def schedulers(self) -> Sequence[Any]:
        return self._schedulers

    @property
    def scaling(self) -> bool:
        """An enabled fp16 grad scaler scales the loss."""
        return self.scaler is not None and bool(self.scaler.is_enabled())

    @property
    def loss_scale(self) -> torch.Tensor | float | None:
        if not self.scaling:
            return None
        scale = getattr(self.scaler, "_scale", None)  # a tensor: read without a sync
        return scale if scale is not None else float(self.scaler.get_scale())

    @property
    def clip(self) -> float | None:
        return self._clip

    def set_clip(self, value: float) -> None:
        self._clip = value

    def _stepping(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        # A step pre-hook: it runs inside the step, after the guard let it through.
        if self.at_step is not None:
            self.at_step(optimizer)
        if self._clip:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            torch.nn.utils.clip_grad_norm_(params, self._clip)

    @property
    def warmup(self) -> int | None:
        if not self._schedulers or not self._optimizers:
            return 0  # a constant LR has no warmup
        group = self._optimizers[0].param_groups[0]
        peak = group.get("initial_lr")
        if not peak:
            return None
        return 0 if group["lr"] >= 0.5 * peak else 1

    @property
    def recount(self) -> bool:
        # Measured inside the step, nothing can write the gradients in between; measured
        # before it (`before_step`), the loop's own code may (a `.data` write, which torch's
        # version counters do not see), so the guard counts them again.
        return self.early

    def reduce(self, vec: torch.Tensor, norms: int) -> torch.Tensor:
        return self.ranks.mean(vec)

    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        return self.ranks.sum(value)

    def gather(self, obj: Any) -> list[Any]:
        return self.ranks.gather(obj)

    def stop(self) -> None:
        self.should_stop = True

    @property
    def checkpoint(self) -> str | None:
        return None  # the loop saves its own checkpoints: the host cannot tell

    @property
    def replays_loss(self) -> bool:
        return False  # the model's calls, not the loop's code around them

    def replay(self, micro: MicroBatch, loss_scale: float) -> Callable[[], torch.Tensor]:
        """The micro-batch's calls of the model again; the loss from what they return."""
        if self.calls is None:
            raise RuntimeError("the model's calls are not recorded")
        return self.calls.replay(micro.batch)

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """A replay's backward does not synchronise across ranks (DDP's ``no_sync``)."""
        with _no_sync(self.model)():
            yield

    def remove(self) -> None:
        """The step hooks off the optimizers."""
        for hook in self._hooks:
            hook.remove()


def _no_sync(model: Any) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """The ``no_sync`` of the first DDP among the wrappers, or a context that does nothing."""
    while isinstance(model, nn.Module):
        if isinstance(model, nn.parallel.DistributedDataParallel):
            return model.no_sync
        model = getattr(model, "_forward_module", None) or getattr(model, "module", None)
    return contextlib.nullcontext


def inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside Fabric's or accelerate's wrapper (which call its ``step``)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer  # type: ignore[attr-defined]
    return optimizer


def loop_facts(model: nn.Module, precision: str, log_dir: Path | None, strategy: str) -> HostFacts:
    """The run's facts: where the model is, the ranks of ``torch.distributed``."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    ranks = Ranks.current()
    return HostFacts(
        precision=precision, accelerator=device.type, devices=1, strategy=strategy,
        world_size=ranks.world_size, rank=ranks.rank, log_dir=log_dir,
    )  # fmt: skip
