"""One optimizer step as measured: numbers on the device, one copy to the host.

`measure` runs after the backward, before the optimizer step (Lightning's
``on_before_optimizer_step``; under a host without that hook, inside the guarded step): it
stacks the gradient norms, the loss, the loss scale, the protection's check of the weights (a
fast test for values that turned non-finite among the parameters, optimizer state and buffers:
`stabilizer.step.protect.Protection.weights_check`) and (on sampled steps) the activation maxima
into one tensor on the device, in float64 where the device has it (a finite 1e300 loss of a
``64-true`` run stays finite), reduces it across ranks, and starts its copy to the host
(`HostCopy`): nothing in it waits for the device. The result is a `Measurement`, frozen: what
the guard then decides is a `stabilizer.step.guard.Decision` of its own. `Probes` are the run's
probes; `Measurer` measures each step with them, a step it cannot measure being a failed one.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from stabilizer.core.isolated import Isolated
from stabilizer.core.signals import GRAD_NORM, LOSS, LR, NONFINITE_GRADS
from stabilizer.live.probes import ActivationProbe, GradProbe, HostCopy
from stabilizer.live.tensors import wide_dtype

from .host import Host

__all__ = ["Measurement", "Measurer", "Probes", "WeightsCheck", "lr_key", "measure"]

log = logging.getLogger("stabilizer")

WeightsCheck = Callable[
    [torch.optim.Optimizer, int], tuple[list[torch.Tensor], torch.Tensor | None]
]
"""``(optimizer, step) -> (tensors, counted)``: what the protection's check of the weights before
a step covers (`stabilizer.step.weights.WeightsWatch.to_check`): the tensors the gradient probe
tests in its pass, and a count already taken of the rest (or None)."""


def lr_key(group: int) -> str:
    """The logged key of a param group's LR: ``lr`` for the first, then ``lr/pg2``, ``lr/pg3`` …

    Numbered from 1 as Lightning's ``LearningRateMonitor`` numbers them (its ``pg1`` is ``lr``).
    """
    return LR if group == 0 else f"{LR}/pg{group + 1}"


@dataclass(frozen=True)
class Measurement:
    """One optimizer step as measured: its numbers (on their way to the host) and settings.

    Args:
        step: The host's global step of the step.
        numbers: The copy of the step's numbers, ordered as `grad_keys`, loss, loss scale,
            non-finite weights, `act_keys`; None when measuring failed.
        grad_keys: The gradient probe's keys at this step.
        gradless: Those of them whose group had no gradient at all (left out of the record).
        act_keys: The activation keys, on a sampled step; else empty.
        scaled: An fp16 grad scaler runs: the loss is scaled, the scaler skips overflow.
        has_loss: A backward ran since the last step (a training step that returned None has
            none: a skipped batch, not a NaN).
        probe: The probe that measured it (whether its gradients changed since).
        optimizer_index: Its optimizer's place among the host's (each its own stream).
        lrs: Each param group's LR as the step uses it (times `auto`'s factor).
        clip: The gradient clipping threshold in force.
        error: Why measuring failed.
    """

    step: int
    numbers: HostCopy | None
    grad_keys: tuple[str, ...] = ()
    gradless: frozenset[str] = frozenset()
    act_keys: tuple[str, ...] = ()
    scaled: bool = False
    has_loss: bool = True
    probe: GradProbe | None = None
    optimizer_index: int = 0
    lrs: tuple[float, ...] = ()
    clip: float | None = None
    error: str = ""

    @classmethod
    def failed(cls, step: int, error: Exception, optimizer_index: int = 0) -> Measurement:
        """A step that could not be measured, and why (one line)."""
        lines = str(error).strip().splitlines()
        why = type(error).__name__ + (f": {lines[0][:200]}" if lines else "")
        return cls(step, None, optimizer_index=optimizer_index, error=why)

    def host(self) -> list[float]:
        """The numbers as Python floats (waits for the copy: the step's one host read)."""
        return self.numbers.read() if self.numbers is not None else []

    def guard_values(self) -> dict[str, float]:
        """Total gradient norm, non-finite count and (when a backward ran) the loss: what the
        guard decides on. Empty when the step could not be measured."""
        if self.numbers is None:
            return {}
        host = self.host()
        values = {GRAD_NORM: host[0], NONFINITE_GRADS: host[1]}
        if self.has_loss:
            values[LOSS] = host[len(self.grad_keys)]
        return values

    @property
    def loss_scale(self) -> float:
        """The grad scaler's scale at the step (1 without one)."""
        if not self.scaled or self.numbers is None:
            return 1.0
        return self.host()[len(self.grad_keys) + 1]

    @property
    def weights_suspect(self) -> bool:
        """The fast test of the weights found something (to be counted exactly)."""
        return self.numbers is not None and self.host()[len(self.grad_keys) + 2] > 0


class Probes:
    """The run's probes: gradient norms over every optimizer's tensors (the run's depth groups),
    one gradient probe per optimizer when there are several (each step is measured on the
    tensors that optimizer updates), the activation maxima when sampled.

    Args:
        module: The model.
        optimizers: The host's optimizers at the start.
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

    def grads_of(self, host: Host, optimizer: torch.optim.Optimizer) -> GradProbe:
        """The gradient probe of `optimizer`'s step."""
        if len(host.optimizers) <= 1:
            return self.grads
        probe = self._each.get(id(optimizer))
        if probe is None:
            probe = GradProbe(self.module, [optimizer], self.grouping)
            self._each[id(optimizer)] = probe
        return probe


class Measurer:
    """Each step's measurement with the run's `Probes` (set at the start). A step that cannot
    be measured is a `Measurement.failed` one (``protect`` skips it), said once; without probes
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
        host: Host,
        optimizer: torch.optim.Optimizer,
        loss: torch.Tensor | None,
        weights: WeightsCheck | None,
        lr_factor: float,
    ) -> Measurement:
        """`measure` with the run's probes, or the failed step."""
        index = next((i for i, opt in enumerate(host.optimizers) if opt is optimizer), 0)
        with Isolated(self.strict) as measuring:
            if self.probes is None:
                raise RuntimeError("the gradient probe could not be built at the start")
            grads = self.probes.grads_of(host, optimizer)
            return measure(host, grads, self.probes.acts, loss, optimizer, weights, lr_factor)
        error = measuring.error
        assert error is not None  # (the block returns unless it failed)
        if not self._warned:
            self._warned = True
            log.warning("stabilizer cannot measure the steps: %r", error, exc_info=error)
        return Measurement.failed(host.step, error, index)


def measure(
    host: Host,
    grads: GradProbe,
    acts: ActivationProbe | None,
    loss: torch.Tensor | None,
    optimizer: torch.optim.Optimizer,
    weights: WeightsCheck | None = None,
    lr_factor: float = 1.0,
) -> Measurement:
    """The step's numbers, stacked on the device and sent to the host without waiting.

    With `weights` (the protection's check), the numbers also count the tensors among the
    parameters, optimizer state and buffers that turned non-finite before this step: the
    gradient probe tests them in its own pass (one ``_foreach_norm``, one reduction).
    """
    step = host.step
    tested, counted = weights(optimizer, step) if weights is not None else (None, None)
    norms = grads(tested)  # the weights' fast test in the same pass: one value past the norms
    checked = norms[-1:] if tested is not None else torch.zeros(1, device=norms.device)
    norms = norms[:-1] if tested is not None else norms
    if counted is not None:
        checked = checked + counted.to(checked.device)
    scale = host.loss_scale
    parts = [norms, _scalar(loss, norms, math.nan), _scalar(scale, norms, 1.0), checked]
    sampled = acts.detach() if acts is not None else None
    if sampled is not None:
        parts.append(sampled if sampled.device == norms.device else sampled.to(norms.device))
    wide = wide_dtype(norms.device)
    vec = torch.cat([part.to(wide) for part in parts])
    if host.facts.world_size > 1:  # every rank must feed the engine the same numbers
        vec = host.reduce(vec, len(norms))
    clip = host.clip
    return Measurement(
        step,
        HostCopy(vec),
        tuple(grads.keys),
        frozenset(grads.gradless),
        tuple(acts.keys) if acts is not None and sampled is not None else (),
        scale is not None,
        has_loss=loss is not None,
        probe=grads,
        optimizer_index=next((i for i, o in enumerate(host.optimizers) if o is optimizer), 0),
        lrs=tuple(_lr(g["lr"]) * lr_factor for g in optimizer.param_groups),
        clip=float(np.float32(clip)) if clip else None,
    )


def _scalar(value: torch.Tensor | float | None, like: torch.Tensor, default: float) -> torch.Tensor:
    if value is None:
        return torch.full((1,), default, device=like.device)
    if not isinstance(value, torch.Tensor):
        return torch.full((1,), float(value), device=like.device)
    value = value.detach().reshape(1)
    return value if value.device == like.device else value.to(like.device)


def _lr(lr: object) -> float:
    """An LR as a float32-rounded Python float (a tensor LR is read once: host side)."""
    value = float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)  # type: ignore[arg-type]
    return float(np.float32(value)) if math.isfinite(value) else value
