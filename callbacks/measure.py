"""One optimizer step as the monitor measures it: numbers on the device, one copy to the host.

`measure` runs in ``on_before_optimizer_step``, after the backward: it stacks the gradient
norms, the loss, the loss scale, the protection's check of the weights (a fast test for values
that turned non-finite among the parameters, optimizer state and buffers: see
`stabilizer.callbacks.protection.Protection.weights_check`) and (on sampled steps) the activation
maxima into one tensor on the device, in float64 where the device has it (a finite 1e300 loss of
a ``64-true`` run stays finite), reduces it across ranks, and starts its copy to the host
(`HostCopy`): nothing in it waits for the device. The result is a
`stabilizer.callbacks.measured.Measured`. `Probes` are the run's probes; `Measurer` measures
each step with them, a step it cannot measure being a failed one.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from stabilizer.live.probes import ActivationProbe, GradProbe, HostCopy
from stabilizer.live.tensors import wide_dtype

from .measured import Measured

__all__ = ["Measurer", "Probes", "WeightsCheck", "measure"]

log = logging.getLogger("stabilizer")

WeightsCheck = Callable[[torch.optim.Optimizer, int, torch.device], torch.Tensor]
"""``(optimizer, step, device) -> count``: the protection's check of the weights before a step."""


class Probes:
    """The run's probes: gradient norms over every optimizer's tensors (the run's depth groups),
    one gradient probe per optimizer when there are several (each step is measured on the
    tensors that optimizer updates), the activation maxima when sampled.

    Args:
        module: The model.
        optimizers: The Trainer's optimizers at fit start.
        grouping: ``parameter name -> depth group``, or None for the naming conventions.
        activations: Whether activations are sampled at all.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        grouping: Callable[[str], str] | None,
        activations: bool,
    ) -> None:
        self.module, self.grouping = module, grouping
        self.grads = GradProbe(module, optimizers, grouping)
        self.acts = ActivationProbe(module) if activations else None
        self._each: dict[int, GradProbe] = {}

    def measure(
        self,
        trainer: pl.Trainer,
        optimizer: torch.optim.Optimizer,
        loss: torch.Tensor | None,
        weights: WeightsCheck | None,
    ) -> Measured:
        """The step of `optimizer`: `measure` with this run's probes (`weights`: the
        protection's check of the weights, when it guards)."""
        grads = self.grads_of(trainer, optimizer)
        return measure(trainer, grads, self.acts, loss, optimizer, weights)

    def sample(self, step: int, every: int) -> None:
        """Sample the activations during this step's forward, every `every` steps (0: never)."""
        if self.acts is not None and every and step % every == 0:
            self.acts.attach()

    def take_seconds(self) -> float:
        """The host time the activation hooks took since the last call."""
        if self.acts is None:
            return 0.0
        seconds, self.acts.seconds = self.acts.seconds, 0.0
        return seconds

    def grads_of(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> GradProbe:
        """The gradient probe of `optimizer`'s step."""
        if len(trainer.optimizers) <= 1:
            return self.grads
        probe = self._each.get(id(optimizer))
        if probe is None:
            probe = GradProbe(self.module, [optimizer], self.grouping)
            self._each[id(optimizer)] = probe
        return probe


class Measurer:
    """Each step's measurement with the run's `Probes` (set at fit start). A step that cannot
    be measured is a `Measured.failed` one (``protect`` skips it), said once; without probes
    (they could not be built) every step is.

    Args:
        strict: Raise instead of warning.
    """

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.probes: Probes | None = None
        self._warned = False

    def __call__(
        self,
        trainer: pl.Trainer,
        optimizer: torch.optim.Optimizer,
        loss: torch.Tensor | None,
        weights: WeightsCheck | None,
    ) -> Measured:
        """`Probes.measure`, or the failed step."""
        try:
            if self.probes is None:
                raise RuntimeError("the gradient probe could not be built at fit start")
            return self.probes.measure(trainer, optimizer, loss, weights)
        except Exception as e:
            if self.strict:
                raise
            if not self._warned:
                self._warned = True
                log.warning("StabilityMonitor cannot measure the steps: %r", e, exc_info=True)
            return Measured.failed(trainer.global_step, e)


def measure(
    trainer: pl.Trainer,
    grads: GradProbe,
    acts: ActivationProbe | None,
    loss: torch.Tensor | None,
    optimizer: torch.optim.Optimizer,
    weights: WeightsCheck | None = None,
) -> Measured:
    """The step's numbers, stacked on the device and sent to the host without waiting.

    With `weights` (the protection's check), the numbers also count the tensors among the
    parameters, optimizer state and buffers that turned non-finite before this step (one more
    reduction in the same copy).
    """
    norms = grads()
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    scale = getattr(scaler, "_scale", None) if scaler is not None else None
    if weights is not None:
        checked = weights(optimizer, trainer.global_step, norms.device).reshape(1)
    else:
        checked = torch.zeros(1, device=norms.device)
    parts = [norms, _scalar(loss, norms, math.nan), _scalar(scale, norms, 1.0), checked]
    sampled = acts.detach() if acts is not None else None
    if sampled is not None:
        parts.append(sampled if sampled.device == norms.device else sampled.to(norms.device))
    wide = wide_dtype(norms.device)
    vec = torch.cat([part.to(wide) for part in parts])
    if trainer.world_size > 1:  # every rank must feed the engine the same numbers
        vec = _reduce(trainer.strategy, vec, len(norms))
    act_keys = list(acts.keys) if acts is not None and sampled is not None else []
    return Measured(
        trainer.global_step,
        HostCopy(vec),
        list(grads.keys),
        frozenset(grads.gradless),
        act_keys,
        scaler is not None,
        has_loss=loss is not None,
        probe=grads,
    )


def _scalar(value: torch.Tensor | None, like: torch.Tensor, default: float) -> torch.Tensor:
    if value is None:
        return torch.full((1,), default, device=like.device)
    value = value.detach().reshape(1)
    return value if value.device == like.device else value.to(like.device)


def _reduce(strategy: Any, vec: torch.Tensor, n: int) -> torch.Tensor:
    """Mean over ranks; a NaN anywhere makes it NaN everywhere, so all ranks decide alike.

    Sharded parameters (FSDP): each rank holds a shard of every gradient, so the norms are
    partial: their squares are summed over ranks (then the square root), the rest averaged.
    """
    if not isinstance(strategy, FSDPStrategy | ModelParallelStrategy):
        return cast(torch.Tensor, strategy.reduce(vec, reduce_op="mean"))
    norms = strategy.reduce(GradProbe.sharded_squares(vec[:n]), reduce_op="sum")
    rest = strategy.reduce(vec[n:], reduce_op="mean")
    return torch.cat((GradProbe.from_squares(norms), rest))
