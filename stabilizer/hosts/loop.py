"""`Stabilizer`: the step in a plain PyTorch loop, or Fabric's — a few lines added to it.

    stab = Stabilizer(model, optimizer, clip=1.0, log_dir="runs/exp")
    for x, y in loader:
        with stab.step():                      # one optimizer step; its micro-batches inside
            logits, loss = model(x, y)         # the model's calls are noted (a replay reruns them)
            stab.backward(loss)                # loss.backward(), the loss noted (and scaled)
            optimizer.step()                   # decided inside: a NaN/Inf step never runs
            optimizer.zero_grad(set_to_none=True)
        if stab.should_stop:                   # a run that stays non-finite stops
            break
    stab.close()                               # the end line, the last check of the weights

The step of Lightning's callback (`stabilizer.step`): the same detection, skip, root cause,
outputs and end line. It is measured inside ``optimizer.step`` (under an fp16 scaler, when it
unscales) and ``clip`` clips after that: ``grad_norm`` is the norm before clipping, as under
Lightning (a loop that clips itself calls ``stab.before_step(optimizer)`` before). A block in
which no optimizer steps is abandoned: nothing of it carries into the next. Under
``torch.distributed`` every rank runs it and takes the same decision. `LoopHost` is the loop as
the step's host: what only the loop can tell.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from stabilizer.step.host import HostFacts
from stabilizer.step.live_outputs import MetricsLogger, Sinks
from stabilizer.step.measurement import carried_scale
from stabilizer.step.monitor import RunMonitor
from stabilizer.step.options import check_precision, options_from
from stabilizer.step.policies import Policy, as_policy
from stabilizer.step.ranks import Ranks
from stabilizer.step.view import RunView

from .calls import Call, ModelCalls, ReplaysCalls, unwrap
from .fabric import FabricSetup
from .moments import AfterUnscale
from .precision import weights_precision
from .scalars import ScalarLogger

__all__ = ["LoopHost", "Stabilizer", "inner_optimizer"]

log = logging.getLogger("stabilizer")


class Stabilizer(RunView):
    """The step in a plain loop (see the module); use it in ``with``, or call `close` at the end.

    Args:
        model: The model the loop calls (DDP's, Fabric's or a compiled wrapper is fine).
        optimizers: The optimizer, or several (each guarded; all that step in one
            ``with stab.step()`` block share its step number).
        policy: ``Protect(...)`` (default), ``Observe()``, ``Auto(...)``, or a name.
        schedulers: The LR schedulers, if any.
        scaler: The fp16 ``torch.amp.GradScaler``, if any (`backward` scales the loss with it).
        clip: Clip the gradient norm at this value in each optimizer step, after measuring it
            (drop the loop's own ``clip_grad_norm_``); None: no clipping by the Stabilizer.
        precision: The run's precision in Lightning's names (``"32-true"``, ``"16-mixed"``,
            ``"bf16-mixed"``, ...): which advice fits, what the set-up check reads. Default:
            ``"16-mixed"`` with an enabled `scaler`, else the weights' (``"32-true"``;
            ``"16-true"`` for a ``.half()`` model, ``"bf16-true"``; say ``"bf16-mixed"``).
        log_dir: Where ``stability.jsonl`` goes (default: ``stability_logs/version_<N>/``).
        tensorboard: A ``SummaryWriter``: the records as scalars, and TensorBoard's extras.
        fabric: A ``lightning.fabric.Fabric``: its backward, scaler, precision and loggers.
        options: The monitor's other settings, by name (`stabilizer.step.options.Options`:
            detectors, grouping, activation_every, heatmap_every, jsonl, strict, preflight,
            notify, cost_budget).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        policy: str | Policy = "protect",
        *,
        schedulers: Sequence[Any] = (),
        scaler: Any = None,
        clip: float | None = None,
        precision: str | None = None,
        log_dir: str | Path | None = None,
        tensorboard: Any = None,
        fabric: Any = None,
        **options: Any,
    ) -> None:
        opts = _optimizers(model, optimizers)
        if clip is not None and not (isinstance(clip, int | float) and not isinstance(clip, bool)):
            raise TypeError(f"`clip` must be a number > 0 or None, got {clip!r}")
        if clip is not None and not clip > 0:
            raise ValueError(f"`clip` must be a number > 0 or None, got {clip!r}")
        if precision is not None:
            check_precision(precision)
        self.policy = as_policy(policy)
        self.options = options_from(options)
        loggers: list[MetricsLogger] = [ScalarLogger(tensorboard)] if tensorboard else []
        setup, strategy = FabricSetup.of(fabric) if fabric is not None else None, "loop"
        self._backward = setup.backward if setup is not None else None
        if setup is not None:
            precision, scaler, strategy = setup.precision, setup.scaler, setup.strategy
            loggers, tensorboard = setup.loggers, tensorboard or setup.tensorboard
            log_dir = log_dir or setup.log_dir
        enabled = scaler if scaler is not None and bool(scaler.is_enabled()) else None
        if precision is None:
            precision = "16-mixed" if enabled is not None else weights_precision(model)
        facts = _facts(model, precision, Path(log_dir) if log_dir else None, strategy)
        self.host = LoopHost(model, opts, schedulers, enabled, facts, clip)
        self._sinks = Sinks(loggers, 1, tensorboard)
        self.run: RunMonitor | None = None  # from the first step (after a resume's state)
        self._resumed: dict[str, Any] | None = None
        self._index = 0  # micro-batches so far
        self._backwards = 0  # in the block in flight
        self._open = False  # inside a `step` block
        self.calls = ModelCalls(self.host.module, self._begin, self._wanted)
        self.host.replays_with(self.calls)
        self._unscale = AfterUnscale(enabled, self.before_step) if enabled is not None else None
        self._closed = False
        self._foreign: set[int] = set()  # optimizers seen stepping nothing of the model
        self._any_step: Any = None  # torch's hook before every optimizer's step

    # --- what the run shows ------------------------------------------------------------------

    @property
    def should_stop(self) -> bool:
        """The protection stopped the run (its bad steps in a row, or weights not intact)."""
        return self.run is not None and self.run.should_stop

    # --- the loop's moments ------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One optimizer step (of every optimizer stepped inside), its micro-batches inside; a
        block in which no optimizer steps is abandoned (nothing of it carries over)."""
        run = self._start()
        self._open, self.calls.fresh = True, True
        noted, self._backwards = self.calls.noted, 0
        try:
            yield
        finally:  # (a block the loop's own code broke out of ends too: abandoned, if unstepped)
            self._open = False
            self.host.ended(run.end())
            if self._backwards and self.calls.noted == noted:  # the loop calls the model's parts
                self.calls.widen()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` (scaled by the fp16 scaler; Fabric's backward under Fabric), the
        loss noted first: under gradient accumulation, each micro-batch's share."""
        host, run = self.host, self.run
        scaled = host.scaler.scale(loss) if host.scaler is not None else loss
        if run is not None and self._open:
            run.loss(scaled)
        self.calls.fresh = True  # the next call of the model begins a micro-batch
        self._backwards += 1
        if self._backward is not None:
            self._backward(loss, **kwargs)
        else:
            scaled.backward(**kwargs)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Measure `optimizer`'s coming step now: call it before your own clipping, so that
        ``grad_norm`` is the norm before it (otherwise it is measured inside the step)."""
        inner = inner_optimizer(optimizer)
        if self.run is not None and self._open and inner in self.host.optimizers:
            self.run.before_step(inner)

    def _begin(self, calls: list[Call]) -> None:
        if self.run is not None:
            self.run.begin(calls, self._index)
            self._index += 1

    def _wanted(self) -> bool:
        return self._open and self.run is not None and not self.run.inert

    def _start(self) -> RunMonitor:
        """The run's monitor, at the first step (after `load_state_dict`, if any)."""
        if self.run is None:
            self.run = RunMonitor(self.host, self.policy, self.options, self._sinks, self._resumed)
            self.host.clip_after_measuring()
            stepping = weakref.WeakMethod(self._stepping)  # (a Stabilizer never closed dies)
            self._any_step = register_optimizer_step_pre_hook(
                lambda opt, args, kwargs: (hook := stepping()) and hook(opt, args, kwargs)
            )
            self.run.start()
        return self.run

    def _stepping(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """torch's hook before any optimizer's step. One made after the Stabilizer over the
        model's parameters (a new optimizer mid-run: two-stage fine-tuning) was unseen: its
        steps unrecorded, a NaN let through. It joins the guarded ones, said once, and this
        step of it is judged here (a skip drops its gradients: it steps over none)."""
        run, host = self.run, self.host
        if run is None or not self._open or run.inert or run.guard.covers(optimizer):
            return
        if id(optimizer) in self._foreign or not _updates(optimizer, host.module):
            self._foreign.add(id(optimizer))
            return
        log.info(
            "stabilizer: an optimizer the Stabilizer was not given (%s) steps the model's "
            "parameters: guarded from this step on", type(optimizer).__name__,
        )  # fmt: skip
        host.optimizers.append(optimizer)
        run.before_step(optimizer)

    def close(self) -> None:
        """The end of training: the last report and check of the weights, the end line; the
        optimizers unguarded, the hooks removed."""
        if self._closed:
            return
        self._closed = True
        run = self._start()
        try:
            run.finish()
        finally:
            self._release(run)

    def _release(self, run: RunMonitor) -> None:
        if self._any_step is not None:
            self._any_step.remove()
        run.release()
        self.calls.remove()
        self.host.remove()
        if self._unscale is not None:
            self._unscale.remove()

    def __enter__(self) -> Stabilizer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if error is None:
            self.close()
        elif not self._closed:  # the training died: keep what was measured, flush every line
            self._closed = True
            run = self._start()
            run.abort()
            self._release(run)

    # --- checkpoints: the step's own state (`RunMonitor.state_dict`) --------------------------

    def state_dict(self) -> dict[str, Any]:
        """The monitor's state, for the loop's checkpoint (resume with `load_state_dict`)."""
        return self._start().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict`'s state: before the first step (a run in progress cannot
        take another's state); the default JSONL of the run it resumes goes on."""
        if self.run is not None:
            raise RuntimeError("`load_state_dict` must come before the first step")
        self._resumed = dict(state)
        self.host.resume_at(int(state.get("step", 0)))


def _optimizers(model: object, optimizers: object) -> list[torch.optim.Optimizer]:
    """The torch optimizers given (unwrapped), each argument checked."""
    if not isinstance(model, nn.Module):
        hint = " (pass the model first, then the optimizer)" if _optimizer(model) else ""
        raise TypeError(f"`model` must be a torch.nn.Module, got {type(model).__name__}{hint}")
    given = [optimizers] if _optimizer(optimizers) else optimizers
    if not isinstance(given, Sequence) or not given or not all(map(_optimizer, given)):
        raise TypeError(
            f"`optimizers` must be a torch optimizer or a sequence of them, got {optimizers!r}"[
                :200
            ]
        )
    return [inner_optimizer(opt) for opt in given]


def _updates(optimizer: torch.optim.Optimizer, model: nn.Module) -> bool:
    """Whether `optimizer` steps any of `model`'s parameters."""
    mine = {id(p) for p in model.parameters()}
    return any(id(p) in mine for group in optimizer.param_groups for p in group["params"])


def _optimizer(obj: object) -> bool:
    return isinstance(obj, torch.optim.Optimizer)


def inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside Fabric's or accelerate's wrapper (which call its ``step``)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer  # type: ignore[attr-defined]
    return optimizer


def _facts(model: nn.Module, precision: str, log_dir: Path | None, strategy: str) -> HostFacts:
    """The run's facts: where the model is, the ranks of ``torch.distributed``."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    ranks = Ranks.current()
    return HostFacts(
        precision=precision, accelerator=device.type, devices=1, strategy=strategy,
        world_size=ranks.world_size, rank=ranks.rank, log_dir=log_dir,
    )  # fmt: skip


class LoopHost(ReplaysCalls):
    """A plain loop (or Fabric's) as the step's host (`stabilizer.step.host.Host`).

    What Lightning's Trainer tells the step, a plain loop tells through `Stabilizer`: the step
    number is the count of its blocks in which an optimizer step was taken, the optimizers and
    schedulers are the ones it was given, the fp16 scaler is the loop's. A root cause replays
    the model's recorded calls (`stabilizer.hosts.calls.ModelCalls`): not the loop's own code
    around them.

    Args:
        model: The model the loop calls (a wrapper: DDP, Fabric's, compiled; or the model).
        optimizers: The optimizers that step (unwrapped: Fabric's and accelerate's wrappers
            call these).
        schedulers: The LR schedulers (a remedy's new parameter group joins them).
        scaler: The enabled fp16 ``torch.amp.GradScaler``, if the loop uses one.
        facts: The run's facts.
        clip: Clip the gradient norm at this value inside each optimizer step, after the step
            is measured (Lightning's ``gradient_clip_val``); None: the host does not clip.
    """

    recount = True  # the loop's own code may write the gradients after `before_step`
    data: object | None = None  # a plain loop does not say (a level change: told by the loss)
    checkpoint: str | None = None  # the loop saves its own checkpoints: the host cannot tell

    def __init__(
        self,
        model: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        schedulers: Sequence[Any],
        scaler: Any,
        facts: HostFacts,
        clip: float | None = None,
    ) -> None:
        self.model, self.module = model, unwrap(model)
        self.optimizers, self.schedulers = list(optimizers), list(schedulers)
        self.scaler, self.facts, self.clip = scaler, facts, clip
        self.step = 0  # the steps taken: a block each (two where an optimizer stepped twice)
        self._hooks: list[Any] = []

    def clip_after_measuring(self) -> None:
        """The clipping goes on each optimizer, as a step pre-hook registered after the run's
        own (under ``observe`` the run measures in one: the norm is the one before clipping)."""
        self._hooks = [opt.register_step_pre_hook(self._clipping) for opt in self.optimizers]

    def set_clip(self, value: float) -> None:
        self.clip = value

    def ended(self, taken: int) -> None:
        """A block ended (`taken`: the step numbers its optimizer steps took; one optimizer
        stepping twice in it takes two)."""
        self.step += taken

    def resume_at(self, step: int) -> None:
        """The run resumes a checkpoint's, taken after `step` steps."""
        self.step = step

    def _clipping(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        """A step pre-hook: inside the step, after the guard let it through. Gradients a grad
        scaler has not unscaled yet (a fused optimizer's) are clipped as if unscaled."""
        if not self.clip:
            return
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params])
        carried = carried_scale(self.scaler, optimizer)
        if carried is not None:
            total = total / carried.to(total)
        torch.nn.utils.clip_grads_with_norm_(params, self.clip, total)

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
        # (Fabric's, DDP's, torch.compile's inner module; by presence: a compiled module's
        # truth value is its module's ``len()``, which a plain module does not have)
        inner = (getattr(model, name, None) for name in ("_forward_module", "module", "_orig_mod"))
        model = next((m for m in inner if isinstance(m, nn.Module)), None)
    return contextlib.nullcontext
