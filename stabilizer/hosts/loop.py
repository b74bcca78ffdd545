"""`Stabilizer`: the step in a plain PyTorch loop, or Fabric's — a few lines added to it.

    stab = Stabilizer(model, optimizer, log_dir="runs/exp")    # guards optimizer.step
    for batch in loader:
        with stab.step():                  # one optimizer step, its micro-batches inside
            loss = model(batch)            # the model's calls are noted (a root cause replays them)
            stab.backward(loss)            # loss.backward(), the loss noted
            optimizer.step()               # decided inside: a NaN/Inf step never runs
            optimizer.zero_grad()
        if stab.should_stop:               # a run that stays non-finite stops
            break
    stab.close()                           # the end line, the last check of the weights

It is the same step as Lightning's callback (`stabilizer.step`): the same detection, skip, root
cause, outputs (``stability.jsonl``, console, notifications, TensorBoard with a
``SummaryWriter``) and end line. Under ``torch.distributed`` every rank runs it and takes the same
decision. The step is measured inside ``optimizer.step``, after any clipping of yours; call
``stab.before_step(optimizer)`` before your clipping to record the norm it clips. Under Fabric,
pass ``fabric.backward`` as `backward` and the optimizers Fabric returned.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stabilizer.core.detectors.base import Detector
from stabilizer.core.records import Finding
from stabilizer.outputs.notify import as_notifier
from stabilizer.step.batch import Batch
from stabilizer.step.guard import StepGuard
from stabilizer.step.host import HostFacts, MicroBatch
from stabilizer.step.monitor import Options, RunMonitor
from stabilizer.step.outputs import Sinks
from stabilizer.step.policies import Policy, as_policy

__all__ = ["LoopHost", "Stabilizer", "loss_of"]


class LoopHost:
    """A plain loop as the step sees it (`stabilizer.step.host.Host`).

    Args:
        model: The model (its forward calls are replayed for a root cause).
        optimizers: The optimizers that step.
        schedulers: The LR schedulers (a remedy's new parameter group joins them).
        scaler: An fp16 ``torch.amp.GradScaler``, if the loop uses one.
        facts: The run's facts (precision, where logs go; ranks from ``torch.distributed``).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        schedulers: Sequence[Any],
        scaler: Any,
        facts: HostFacts,
    ) -> None:
        self.model, self._optimizers, self._schedulers = model, list(optimizers), list(schedulers)
        self.scaler, self._facts = scaler, facts
        self.done = 0  # optimizer steps of the steps finished
        self.batch: Batch | None = None  # the step in flight (its optimizer steps so far)
        self.should_stop = False
        self.early = False  # this step was measured before `optimizer.step` (`before_step`)
        self._clip: float | None = None
        for opt in self._optimizers:  # the clipping a remedy sets, at the last moment
            opt.register_step_pre_hook(self._clip_before_update)

    @property
    def facts(self) -> HostFacts:
        return self._facts

    @property
    def step(self) -> int:
        return self.done + (len(self.batch.steps) if self.batch is not None else 0)

    @property
    def module(self) -> nn.Module:
        return self.model

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
    def loss_scale(self) -> torch.Tensor | float | None:
        if self.scaler is None or not self.scaler.is_enabled():
            return None
        return float(self.scaler.get_scale())

    @property
    def clip(self) -> float | None:
        return self._clip

    def set_clip(self, value: float) -> None:
        self._clip = value

    def _clip_before_update(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
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
        if self._facts.world_size <= 1:
            return vec
        out = vec.clone()
        torch.distributed.all_reduce(out)
        return out / self._facts.world_size

    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        if self._facts.world_size <= 1:
            return value
        out = value.clone()
        torch.distributed.all_reduce(out)
        return out

    def gather(self, obj: Any) -> list[Any]:
        if self._facts.world_size <= 1:
            return [obj]
        gathered: list[Any] = [None] * self._facts.world_size
        torch.distributed.all_gather_object(gathered, obj)  # our own processes' objects
        return gathered

    def stop(self) -> None:
        self.should_stop = True

    @property
    def checkpoint(self) -> str:
        return ""

    def replay(self, micro: MicroBatch, loss_scale: float) -> Callable[[], torch.Tensor]:
        """The micro-batch's model calls again; the loss from what they return (`loss_of`)."""
        args, kwargs = micro.batch

        def run_step() -> torch.Tensor:
            return loss_of(self.model(*args, **kwargs))

        return run_step

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """A replay's backward does not synchronise across ranks (DDP's ``no_sync``)."""
        with getattr(self.model, "no_sync", contextlib.nullcontext)():
            yield


def loss_of(output: Any) -> torch.Tensor:
    """The loss in what a model returned: a scalar tensor, a ``loss`` entry or attribute (a
    Hugging Face model's output), the first scalar of a tuple (nanoGPT's ``(logits, loss)``);
    else the mean of the first tensor (a replay without a loss still finds a forward NaN)."""
    if isinstance(output, torch.Tensor):
        return output if output.numel() == 1 else output.float().mean()
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, tuple | list):
        scalars = [o for o in output if isinstance(o, torch.Tensor) and o.numel() == 1]
        tensors = [o for o in output if isinstance(o, torch.Tensor)]
        if scalars or tensors:
            return scalars[0] if scalars else tensors[0].float().mean()
    raise TypeError(f"no loss in the model's output ({type(output).__name__})")


class Stabilizer:
    """The step in a plain loop (see the module): guards the optimizers from construction on.

    Args:
        model: The model the loop trains (under DDP, the wrapped one).
        optimizers: The optimizer, or several.
        policy: ``Protect(...)`` (default), ``Observe()``, ``Auto(...)``, or a name.
        schedulers: The LR schedulers, if any.
        scaler: The fp16 ``GradScaler``, if any (`backward` scales the loss with it).
        precision: The run's precision in Lightning's names (``"32-true"``, ``"16-mixed"``,
            ``"bf16-mixed"``, ...): what fits as advice, what the preflight checks.
        log_dir: Where ``stability.jsonl`` goes (default: ``stability_logs/version_<N>/``).
        tensorboard: A ``SummaryWriter`` for the records and TensorBoard's extras.
        backward: How to backpropagate a loss (default ``loss.backward()``; Fabric's
            ``fabric.backward``).
        options: The monitor's other settings (`stabilizer.step.monitor.Options`: detectors,
            grouping, activation_every, heatmap_every, jsonl, strict, preflight, notify,
            cost_budget).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        policy: str | Policy = "protect",
        *,
        schedulers: Sequence[Any] = (),
        scaler: Any = None,
        precision: str = "32-true",
        log_dir: str | Path | None = None,
        tensorboard: Any = None,
        backward: Callable[[torch.Tensor], None] | None = None,
        detectors: Sequence[Detector] | None = None,
        **options: Any,
    ) -> None:
        opts = list(optimizers) if isinstance(optimizers, Sequence) else [optimizers]
        notify = options.pop("notify", None)
        self.options = Options(detectors=detectors, notify=as_notifier(notify), **options)
        self.host = LoopHost(model, opts, schedulers, scaler, _facts(model, precision, log_dir))
        self._backward = backward
        sinks = Sinks((), 1, tensorboard)
        self.run = RunMonitor(self.host, as_policy(policy), self.options, sinks)
        self.host.batch = self.run.batch
        self._index = 0  # micro-batches so far
        self._open = False  # a step is in flight
        self._calls = model.register_forward_pre_hook(self._called, with_kwargs=True)
        self.run.start()

    # --- what the run shows ------------------------------------------------------------------

    @property
    def findings(self) -> list[Finding]:
        return self.run.findings

    @property
    def skipped_steps(self) -> int:
        return self.run.skipped_steps

    @property
    def guard(self) -> StepGuard | None:
        return self.run.guard

    @property
    def should_stop(self) -> bool:
        """The protection stopped the run (its bad steps in a row, or weights not intact)."""
        return self.host.should_stop

    # --- the loop's moments ------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One optimizer step (of every optimizer stepped inside), its micro-batches inside."""
        self._open = True
        try:
            yield
        finally:
            self._open = False
            taken = len(self.run.batch.steps)
            self.run.end()
            self.host.done += taken
            self.host.early = False

    def _called(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """A forward of the model: the first since the last backward starts a micro-batch."""
        if self.run.inert or not self._open:
            return
        if not self.run.batch.micro or self.run.batch.micro[-1].losses:
            self.run.begin((args, kwargs), self._index)
            self._index += 1

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` (scaled by the fp16 scaler, or Fabric's), the loss noted first."""
        scaler = self.host.scaler
        scaled = scaler.scale(loss) if scaler is not None and scaler.is_enabled() else loss
        self.run.loss(scaled)
        if self._backward is not None:
            self._backward(loss, **kwargs)
        else:
            scaled.backward(**kwargs)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Measure `optimizer`'s coming step now (before your clipping, to record the norm it
        clips); otherwise it is measured inside ``optimizer.step``."""
        self.run.before_step(optimizer)
        self.host.early = True

    def close(self) -> None:
        """The end of training: the last report and check of the weights, the end line; the
        optimizers unguarded."""
        try:
            self.run.finish()
        finally:
            self.run.release()
            self._calls.remove()

    def state_dict(self) -> dict[str, Any]:
        """The monitor's state, for the loop's checkpoint (resume with `load_state_dict`)."""
        return self.run.state_dict() | {"step": self.host.done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run.load_state_dict(state)
        self.host.done = int(state.get("step", 0))


def _facts(model: nn.Module, precision: str, log_dir: str | Path | None) -> HostFacts:
    """The run's facts: where the model is, the ranks of ``torch.distributed``."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    world = torch.distributed.get_world_size() if distributed else 1
    rank = torch.distributed.get_rank() if distributed else 0
    return HostFacts(
        precision=precision, accelerator=device.type, devices=1, strategy="loop",
        world_size=world, rank=rank, log_dir=Path(log_dir) if log_dir else None,
    )  # fmt: skip
