"""One optimizer step as measured: numbers on the device, one copy to the host.

`measure` runs when the gradients are ready and before the optimizer steps (Lightning's
``on_before_optimizer_step``; a scaler's ``unscale_``; else inside the guarded step): it stacks
the gradient norms, the loss, the loss scale, the protection's fast check of the weights (a test
for values that turned non-finite among the parameters, optimizer state and buffers) and (on
sampled steps) the activation maxima into one tensor on the device, in float64 where the device
has it (a finite 1e300 loss of a ``64-true`` run stays finite), reduces it across ranks, and
starts its copy to the host (`HostCopy`): nothing in it waits for the device. The result is a
frozen `Measurement`; `Measurement.read` is the step's one host read (`Numbers`).

Unscaled, always: gradients an fp16 grad scaler has not unscaled yet still carry its scale — a
fused optimizer unscales inside its own step, so the scaler never unscales them before it
(`carried_scale`). Their norms are divided by that scale here, whatever the optimizer.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from stabilizer.core.isolated import Isolated
from stabilizer.live.probes import ActivationProbe, GradProbe
from stabilizer.live.tensors import HostCopy, wide_dtype

from .ranks import Ranks

__all__ = [
    "Measurement",
    "Measurer",
    "Numbers",
    "Probes",
    "WeightsCheck",
    "carried_scale",
    "measure",
]

log = logging.getLogger("stabilizer")

WeightsCheck = Callable[
    [torch.optim.Optimizer, int], tuple[list[torch.Tensor], torch.Tensor | None]
]
"""``(optimizer, step) -> (tensors, counted)``: what the protection's check of the weights before
a step covers (`stabilizer.step.weights.WeightsWatch.to_check`): the tensors the gradient probe
tests in its pass, and a count already taken of the rest (or None)."""


def carried_scale(scaler: object, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """The scale `optimizer`'s gradients still carry: the enabled scaler's, unless it unscaled
    them this step (torch's ``GradScaler`` keeps each optimizer's stage; a fused optimizer gets
    the scale as ``optimizer.grad_scale`` and unscales inside its step). None: unscaled."""
    if scaler is None or not scaler.is_enabled():  # type: ignore[attr-defined]
        return None
    states = getattr(scaler, "_per_optimizer_states", {})
    state = states.get(id(optimizer)) if isinstance(states, dict) else None
    if state is not None and getattr(state.get("stage"), "name", "") == "UNSCALED":
        return None
    given = getattr(optimizer, "grad_scale", None)  # (set by `scaler.step` for a fused one)
    scale = given if given is not None else getattr(scaler, "_scale", None)
    return scale if isinstance(scale, torch.Tensor) else None


@dataclass(frozen=True)
class Numbers:
    """A step's numbers on the host: what the guard decides on and the record holds.

    Args:
        grads: The gradient probe's values, ordered as its keys (``grad_norm``,
            ``nonfinite_grads``, then each depth group's norm).
        loss: The step's loss (as the host handed it: scaled under a scaler), or None when no
            backward ran.
        scale: The grad scaler's scale (1 without one).
        weights: The fast check of the weights: above 0 when a value may have turned non-finite.
        acts: The activation maxima of a sampled step.
    """

    grads: tuple[float, ...]
    loss: float | None
    scale: float
    weights: float
    acts: tuple[float, ...]

    @property
    def grad_norm(self) -> float:
        return self.grads[0]

    @property
    def nonfinite_grads(self) -> float:
        return self.grads[1]


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
        lrs: Each param group's LR as the step uses it (times `auto`'s factor); None for a
            group whose LR is no number (``Adafactor(lr=None)`` computes its own).
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
    lrs: tuple[float | None, ...] = ()
    clip: float | None = None
    error: str = ""

    @classmethod
    def failed(cls, step: int, error: Exception) -> Measurement:
        """A step that could not be measured, and why (one line)."""
        lines = str(error).strip().splitlines()
        why = type(error).__name__ + (f": {lines[0][:200]}" if lines else "")
        return cls(step, None, error=why)

    def read(self) -> Numbers | None:
        """The numbers on the host (waits for the copy: the step's one host read); None when
        the step could not be measured."""
        if self.numbers is None:
            return None
        host, n = self.numbers.read(), len(self.grad_keys)
        loss = host[n] if self.has_loss else None
        return Numbers(tuple(host[:n]), loss, host[n + 1], host[n + 2], tuple(host[n + 3 :]))


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
        self.sampled = False  # activations sampled since `take_seconds` (their hooks timed)

    def sample(self, step: int, every: int) -> None:
        """Sample the activations during this step's forward, every `every` steps (0: never)."""
        if self.acts is not None and every and step % every == 0:
            self.acts.attach()
            self.sampled = True

    def take_seconds(self) -> float:
        """The host time the activation hooks took since the last call."""
        self.sampled = False
        if self.acts is None:
            return 0.0
        seconds, self.acts.seconds = self.acts.seconds, 0.0
        return seconds

    def grads_of(self, optimizer: torch.optim.Optimizer, alone: bool) -> GradProbe:
        """The gradient probe of `optimizer`'s step (`alone`: the run's only optimizer)."""
        if alone:
            return self.grads
        probe = self._each.get(id(optimizer))
        if probe is None:
            probe = GradProbe(self.module, [optimizer], self.grouping)
            self._each[id(optimizer)] = probe
        return probe


@dataclass(frozen=True)
class Setting:
    """What the step needs of the run at a measurement, besides the gradients.

    Args:
        step: The global step.
        scaler: The fp16 grad scaler (None: none).
        clip: The clipping threshold in force.
        ranks: The processes of the run (their reduction).
        sharded: Parameters are sharded across ranks (their norms' squares are summed).
        lr_factor: `auto`'s LR multiplier.
        alone: The run has one optimizer.
    """

    step: int
    scaler: object
    clip: float | None
    ranks: Ranks
    sharded: bool = False
    lr_factor: float = 1.0
    alone: bool = True


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
        self._unread: set[int] = set()  # optimizers whose LR is no number: said once each

    def __call__(
        self,
        optimizer: torch.optim.Optimizer,
        loss: torch.Tensor | None,
        weights: WeightsCheck | None,
        setting: Setting,
    ) -> Measurement:
        """`measure` with the run's probes, or the failed step."""
        with Isolated(self.strict) as measuring:
            if self.probes is None:
                raise RuntimeError("the gradient probe could not be built at the start")
            grads = self.probes.grads_of(optimizer, setting.alone)
            measured = measure(grads, self.probes.acts, loss, optimizer, weights, setting)
            if None in measured.lrs and id(optimizer) not in self._unread:
                self._unread.add(id(optimizer))
                _said_lr(optimizer, setting.ranks.rank == 0)
            return measured
        error = measuring.error
        assert error is not None  # (the block returns unless it failed)
        if not self._warned:
            self._warned = True
            log.warning("stabilizer cannot measure the steps: %r", error, exc_info=error)
        return Measurement.failed(setting.step, error)


def measure(
    grads: GradProbe,
    acts: ActivationProbe | None,
    loss: torch.Tensor | None,
    optimizer: torch.optim.Optimizer,
    weights: WeightsCheck | None,
    setting: Setting,
) -> Measurement:
    """The step's numbers, stacked on the device and sent to the host without waiting.

    With `weights` (the protection's check), the numbers also count the tensors among the
    parameters, optimizer state and buffers that turned non-finite before this step: the
    gradient probe tests them in its own pass (one ``_foreach_norm``, one reduction).
    """
    tested, counted = weights(optimizer, setting.step) if weights is not None else (None, None)
    norms = grads(tested)  # the weights' fast test in the same pass: one value past the norms
    checked = norms[-1:] if tested is not None else torch.zeros(1, device=norms.device)
    norms = norms[:-1] if tested is not None else norms
    if counted is not None:
        checked = checked + counted.to(checked.device)
    carried = carried_scale(setting.scaler, optimizer)
    if carried is not None:  # (the count of non-finite gradients stays as it is)
        factor = carried.to(norms).reshape(1)
        norms = torch.cat((norms[:1] / factor, norms[1:2], norms[2:] / factor))
    scaler = setting.scaler
    scale = _scale_of(scaler)
    parts = [norms, _scalar(loss, norms, math.nan), _scalar(scale, norms, 1.0), checked]
    sampled = acts.detach() if acts is not None else None
    if sampled is not None:
        parts.append(sampled if sampled.device == norms.device else sampled.to(norms.device))
    wide = wide_dtype(norms.device)
    vec = torch.cat([part.to(wide) for part in parts])
    ranks = setting.ranks
    if ranks.world_size > 1:  # every rank must feed the engine the same numbers
        vec = ranks.reduce(vec, len(norms), setting.sharded)
    clip = setting.clip
    return Measurement(
        setting.step,
        HostCopy(vec),
        tuple(grads.keys),
        frozenset(grads.gradless),
        tuple(acts.keys) if acts is not None and sampled is not None else (),
        scale is not None,
        has_loss=loss is not None,
        probe=grads,
        lrs=tuple(_lr(g.get("lr"), setting.lr_factor) for g in optimizer.param_groups),
        clip=float(np.float32(clip)) if clip else None,
    )


def _said_lr(optimizer: torch.optim.Optimizer, speaks: bool) -> None:
    """Once per optimizer: its LR is no number (it computes its own): not checked, not
    logged; the step goes on as the user wrote it."""
    if speaks:
        lr = next(g.get("lr") for g in optimizer.param_groups if _lr(g.get("lr"), 1.0) is None)
        log.info(
            "stabilizer: %s sets no learning rate the step can read (lr=%r: it computes its "
            "own): its LR cannot be checked or logged; every other check is made (said once)",
            type(optimizer).__name__, lr,
        )  # fmt: skip


def _scale_of(scaler: object) -> torch.Tensor | float | None:
    """The enabled fp16 scaler's scale (a tensor: read without a sync), or None."""
    if scaler is None or not scaler.is_enabled():  # type: ignore[attr-defined]
        return None
    scale = getattr(scaler, "_scale", None)
    return scale if scale is not None else float(scaler.get_scale())  # type: ignore[attr-defined]


def _scalar(value: torch.Tensor | float | None, like: torch.Tensor, default: float) -> torch.Tensor:
    if value is None:
        return torch.full((1,), default, device=like.device)
    if not isinstance(value, torch.Tensor):
        return torch.full((1,), float(value), device=like.device)
    value = value.detach().reshape(1)
    return value if value.device == like.device else value.to(like.device)


def _lr(lr: object, factor: float) -> float | None:
    """An LR as a float32-rounded Python float (a tensor LR is read once: host side), times
    `factor`; None when it is no number (an optimizer that computes its own)."""
    if isinstance(lr, torch.Tensor):
        value = float(lr.item())
    elif isinstance(lr, int | float):
        value = float(lr)
    else:
        return None
    value *= factor
    return float(np.float32(value)) if math.isfinite(value) else value
