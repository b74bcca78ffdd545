"""Where a first non-finite step went NaN/Inf: its batch replayed under hooks, the module named.

Nothing is hooked in steady state. When a step first turns NaN/Inf, the caller hands
`locate_nonfinite` a closure that re-runs that step's forward on the same batch, before the
optimizer step (same weights), with the random state captured before the step. The replay runs
with a forward and a full backward hook on every module, all removed afterwards, and leaves the
caller's ``.grad`` tensors exactly as they were (fairseq's ``NanDetector`` does the same with
hooks left on for a whole step).

A replay that stays finite did not reproduce the fault: it is then classed ``"transient"``
(non-deterministic kernels or hardware, what Megatron's rerun state machine checks for), otherwise
``"numerical"``.

An optimizer can write NaN/Inf into finite weights from finite gradients (fp16 AdamW: ``eps=1e-8``
rounds to 0, so ``exp_avg / sqrt(exp_avg_sq)`` divides by zero). The next step is then the first
non-finite one and its weights are already bad: `locate_nonfinite` reports phase ``"weights"`` when
a module that ran in the replay holds them (a NaN weight no module used is not the cause), and
`optimizer_produced_nonfinite` lets a caller that checked the weights before the step confirm it.
A batch that already holds NaN/Inf is phase ``"input"``, whichever module it reaches first.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from .held import HeldNonFinite
from .rng import RngState
from .tensors import all_finite

__all__ = [
    "ROOT",
    "Localization",
    "Phase",
    "locate_nonfinite",
    "optimizer_produced_nonfinite",
]

logger = logging.getLogger(__name__)

Phase = Literal["weights", "input", "forward", "backward", "loss", "none"]

_HOOK_WARNINGS = "(Full backward hook is firing|For backward hooks to be called)"

ROOT = "<model>"
"""The replay's name for the model itself (``named_modules`` calls it ``""``); a `Localization`
names it by its class instead (`_by_class`): ``TinyLM.forward``, ``TinyLM``."""


@dataclass(frozen=True)
class Localization:
    """Where the replay of a failing step first produced NaN/Inf.

    Args:
        phase: ``"weights"`` (a parameter was already non-finite before the replay),
            ``"input"`` (the batch itself), ``"forward"``, ``"backward"``, ``"loss"`` (only the
            loss, computed outside every module) or ``"none"`` (the replay stayed finite).
        module: The module's ``named_modules`` name, or None; the model itself by its class:
            ``TinyLM.forward`` for a fault in its own ``forward`` (outside every submodule),
            ``TinyLM`` for a weight it holds itself.
        parameter: The parameter's name for ``"weights"`` and gradient-only findings, else None.
        input_absmax: Largest ``|x|`` flowing into the module: its inputs in the forward phase,
            the gradient w.r.t. its outputs in the backward phase; NaN when not applicable.
        output_absmax: Largest ``|x|`` it produced: its outputs (forward) or the gradient w.r.t.
            its inputs (backward); NaN when not applicable.
        loss: The replayed loss.
        reproduced: Whether the replay produced a non-finite value at all.
        elapsed_s: Wall time of the localization.
    """

    phase: Phase
    module: str | None
    parameter: str | None = None
    input_absmax: float = math.nan
    output_absmax: float = math.nan
    loss: float = math.nan
    reproduced: bool = True
    elapsed_s: float = 0.0

    @property
    def cause(self) -> Literal["numerical", "transient"]:
        """``"numerical"`` when the replay reproduced the fault, else ``"transient"``."""
        return "numerical" if self.reproduced else "transient"

    @property
    def message(self) -> str:
        """One line for a human: what went non-finite, where, and in which phase."""
        if not self.reproduced:
            return "the replay of the step stayed finite: transient (non-deterministic) fault"
        where = self.module if self.parameter is None else self.parameter
        return {
            "weights": f"the weights are non-finite before the step ({where})",
            "input": "the input batch holds NaN/Inf",
            "forward": f"{where} produced NaN/Inf in the forward pass from finite inputs",
            "backward": f"{where} produced a NaN/Inf gradient from finite incoming gradients"
            if self.parameter is None
            else f"the gradient of {where} is NaN/Inf; every activation gradient is finite",
            "loss": (
                "only the loss is non-finite; every module output is finite: look at the loss "
                "computation and its inputs (targets, masks, a division by a zero count)"
            ),
            "none": "nothing non-finite found",
        }[self.phase]

    @property
    def evidence(self) -> dict[str, float]:
        """The numbers, as `stabilizer.core.records.Finding` evidence."""
        return {
            "input_absmax": self.input_absmax,
            "output_absmax": self.output_absmax,
            "loss": self.loss,
            "reproduced": float(self.reproduced),
            "elapsed_s": self.elapsed_s,
        }


def locate_nonfinite(
    model: nn.Module,
    run_step: Callable[[], Tensor],
    *,
    rng_state: RngState | None = None,
    loss_scale: float = 1.0,
    inputs: Any = None,
    held: HeldNonFinite | None = None,
) -> Localization:
    """Replay a failing step under hooks and name the module where NaN/Inf first appeared.

    Rule: a batch (`inputs`) holding NaN/Inf is the cause, whatever module it reaches first.
    Else the first module, in order of forward *completion*, whose output is non-finite while its
    inputs are finite: a module completes after its children, so this is the innermost module
    whose own computation made the value (a fault in ``blocks.1.mlp.c_fc`` names ``c_fc``, one
    in a functional op of ``blocks.1.mlp.forward`` names ``blocks.1.mlp``); when that module
    holds a non-finite weight, the weight is the cause. Otherwise the first module, in backward
    order, whose gradient w.r.t. its inputs is non-finite while the gradient w.r.t. its outputs
    is finite (innermost again); otherwise the first parameter with a non-finite gradient (its
    owning module); otherwise the loss alone. A non-finite weight of a module the replay never
    ran is no cause.

    Args:
        model: The model; every submodule is hooked for the replay only.
        run_step: Runs the failing step's forward (under the caller's autocast, if any) on the same
            batch and returns the loss. It must not call ``backward`` unless it returns a loss
            that does not require grad (then the replay does not call it either).
        rng_state: Random state captured before the failing step (dropout masks); the current
            state is restored after the replay either way.
        loss_scale: Multiplies the loss before ``backward``, as a ``GradScaler`` would, so an fp16
            gradient overflow is reproduced.
        inputs: The failing batch (tensors, nested in tuples, lists or dicts); checked first.
        held: What the model held as NaN/Inf by design (`stabilizer.live.held`): a weight
            non-finite only there is no cause.

    Returns:
        The localization; ``reproduced`` is False when the replay stayed finite.

    Raises:
        ValueError: ``loss_scale`` is not a finite positive number.
    """
    if not (math.isfinite(loss_scale) and loss_scale > 0):
        raise ValueError(f"`loss_scale` must be finite and > 0, got {loss_scale}")
    start = time.perf_counter()
    if inputs is not None and not math.isfinite(_incoming(inputs)):
        return Localization("input", None, elapsed_s=time.perf_counter() - start)
    named_params = list(model.named_parameters())
    bad_weights = _all_nonfinite(named_params, lambda p: p)
    if held:
        bad_weights = [n for n, p in named_params if n in bad_weights and held.changed([p])]
    saved_grads = [(p, p.grad) for _, p in named_params]  # references: the replay makes new ones
    after = RngState.capture()
    try:
        recorder = _replay_with_fallback(model, run_step, rng_state, loss_scale)
        bad_grad = next(iter(_all_nonfinite(named_params, lambda p: p.grad)), None)
    finally:
        for p, grad in saved_grads:
            p.grad = grad
        after.restore()
    found = recorder.localize(bad_grad, time.perf_counter() - start)
    weight = next((w for w in bad_weights if _owner(w) in recorder.ran), None)
    blamed = found.phase in ("none", "loss") or (
        found.phase == "forward" and weight is not None and _within(_owner(weight), found.module)
    )
    if weight is not None and blamed:
        found = Localization("weights", _owner(weight), weight, elapsed_s=found.elapsed_s)
    return _by_class(found, model)


def _by_class(found: Localization, model: nn.Module) -> Localization:
    """``found`` with the model itself named by its class: ``<model>`` told a user nothing when
    the fault was in their LightningModule's own ``forward``."""
    if found.module != ROOT:
        return found
    name = type(model).__name__
    return replace(found, module=name if found.phase == "weights" else f"{name}.forward")


def _within(module: str, outer: str | None) -> bool:
    return outer is not None and (
        module == outer or outer == ROOT or module.startswith(outer + ".")
    )


def _replay_with_fallback(
    model: nn.Module, run_step: Callable[[], Tensor], rng: RngState | None, loss_scale: float
) -> _Recorder:
    try:
        return _replay(model, run_step, rng, loss_scale, backward_hooks=True)
    except RuntimeError as err:
        # Full backward hooks refuse in-place ops on a module's output (nn.ReLU(inplace=True)).
        logger.warning("replay with backward hooks failed (%s); replaying forward hooks only", err)
        return _replay(model, run_step, rng, loss_scale, backward_hooks=False)


def _replay(
    model: nn.Module,
    run_step: Callable[[], Tensor],
    rng: RngState | None,
    loss_scale: float,
    *,
    backward_hooks: bool,
) -> _Recorder:
    for p in model.parameters():
        p.grad = None  # the caller's are saved; a failed first try may have left some
    recorder = _Recorder(model)
    handles = recorder.attach(model, backward_hooks)
    try:
        with warnings.catch_warnings(), torch.enable_grad():
            # Our temporary hooks on modules without grad-requiring inputs or with dict outputs.
            warnings.filterwarnings("ignore", message=_HOOK_WARNINGS, category=UserWarning)
            if rng is not None:
                rng.restore()
            loss = run_step()
            recorder.loss = (
                float(loss.detach().float().reshape(-1)[0]) if loss.numel() else math.nan
            )
            if recorder.forward_finite and math.isfinite(recorder.loss) and loss.requires_grad:
                torch.autograd.backward(loss * loss_scale)
    finally:
        for handle in handles:
            handle.remove()
    return recorder


@dataclass
class _Event:
    module: str
    incoming: float
    produced: float


@dataclass
class _Recorder:
    """The hooks of one replay and what they saw."""

    model: nn.Module
    names: dict[nn.Module, str] = field(default_factory=dict)
    forward_event: _Event | None = None
    backward_event: _Event | None = None
    forward_finite: bool = True
    input_finite: bool = True
    loss: float = math.nan
    ran: set[str] = field(default_factory=set)  # the modules whose forward ran

    def attach(self, model: nn.Module, backward_hooks: bool) -> list[RemovableHandle]:
        handles = []
        for name, module in model.named_modules():
            self.names[module] = name or ROOT
            handles.append(module.register_forward_hook(self._on_forward, with_kwargs=True))
            if backward_hooks:
                handles.append(module.register_full_backward_hook(self._on_backward))
        return handles

    def _on_forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        self.ran.add(self.names[module])
        if self.forward_event is not None:
            return
        produced = _incoming(output)  # (a module that builds a -inf mask made no fault)
        if math.isfinite(produced):
            return
        self.forward_finite = False
        incoming = _incoming((args, kwargs))
        if math.isfinite(incoming):
            self.forward_event = _Event(self.names[module], incoming, produced)
        elif module is self.model:
            self.input_finite = False

    def _on_backward(self, module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        if self.backward_event is not None:
            return
        produced = _absmax(grad_input)
        incoming = _absmax(grad_output)
        if not math.isfinite(produced) and math.isfinite(incoming):
            self.backward_event = _Event(self.names[module], incoming, produced)

    def localize(self, bad_grad: str | None, elapsed_s: float) -> Localization:
        found = Localization("none", None, loss=self.loss, reproduced=False, elapsed_s=elapsed_s)
        events: tuple[tuple[Phase, _Event | None], ...] = (
            ("forward", self.forward_event),
            ("backward", self.backward_event),
        )
        for phase, event in events:
            if event is not None:
                return Localization(
                    phase,
                    event.module,
                    input_absmax=event.incoming,
                    output_absmax=event.produced,
                    loss=self.loss,
                    elapsed_s=elapsed_s,
                )
        if not self.input_finite:
            return replace(found, phase="input", reproduced=True)
        if not (self.forward_finite and math.isfinite(self.loss)):
            # A non-finite loss makes every gradient so (a step that backpropagates itself,
            # under manual optimization, has done it already): the loss is the cause.
            return replace(found, phase="loss", reproduced=True)
        if bad_grad is not None:
            owner = _owner(bad_grad)
            return replace(
                found, phase="backward", module=owner, parameter=bad_grad, reproduced=True
            )
        return found


def _owner(parameter: str) -> str:
    return parameter.rpartition(".")[0] or ROOT


def _tensors(obj: Any) -> Iterator[Tensor]:
    """The non-empty floating tensors in ``obj`` (nested tuples, lists, dicts); others skipped."""
    if isinstance(obj, Tensor):
        if obj.is_floating_point() and obj.numel() > 0:
            yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from _tensors(value)


def _absmax(obj: Any) -> float:
    """Largest ``|x|`` over the floating tensors in ``obj``: NaN if any holds NaN, 0.0 if none."""
    values = [float(t.detach().abs().amax()) for t in _tensors(obj)]
    if any(math.isnan(v) for v in values):
        return math.nan
    return max(values, default=0.0)


def _incoming(obj: Any) -> float:
    """`_absmax` of what flows into or out of a module (or a step), additive attention masks
    left out: a tensor of only 0 and ``-inf`` (``generate_square_subsequent_mask``, a float
    ``key_padding_mask``) is ``-inf`` by design, no NaN/Inf a module made or took in."""
    values = []
    for t in _tensors(obj):
        peak = float(t.detach().abs().amax())
        if not math.isfinite(peak) and _additive_mask(t):
            continue
        values.append(peak)
    if any(math.isnan(v) for v in values):
        return math.nan
    return max(values, default=0.0)


def _additive_mask(t: Tensor) -> bool:
    t = t.detach()
    return bool(((t == 0) | (t == -math.inf)).all())


def _all_nonfinite(
    named: list[tuple[str, nn.Parameter]], get: Callable[[nn.Parameter], Tensor | None]
) -> list[str]:
    tensors = [(n, get(p)) for n, p in named]
    present = [(n, t) for n, t in tensors if t is not None]
    if all_finite(t for _, t in present):
        return []  # the usual case: one host sync, no per-tensor look
    return [n for n, t in present if not all_finite([t])]


def optimizer_produced_nonfinite(
    params_finite_before: bool, params_after: Iterable[Tensor]
) -> bool:
    """Whether an optimizer step turned finite weights non-finite: the optimizer is the source.

    Args:
        params_finite_before: `all_finite` of the parameters just before ``optimizer.step()``.
        params_after: The parameters (or `optimizer_state_tensors`) just after it.
    """
    return params_finite_before and not all_finite(params_after)
