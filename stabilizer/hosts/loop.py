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
Lightning (a loop that clips itself calls ``stab.before_step(optimizer)`` before). Under
``torch.distributed`` every rank runs it and takes the same decision.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from stabilizer.core.records import Finding
from stabilizer.outputs.notify import as_notifier
from stabilizer.step.live_outputs import MetricsLogger, Sinks
from stabilizer.step.monitor import Options, RunMonitor, RunView
from stabilizer.step.policies import Policy, as_policy

from .calls import Call, ModelCalls
from .fabric import FabricSetup
from .loop_host import LoopHost, inner_optimizer, loop_facts
from .moments import AfterUnscale, measure_once
from .scalars import ScalarLogger

__all__ = ["Stabilizer"]


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
            ``"16-mixed"`` with an enabled `scaler`, else ``"32-true"`` (say ``"bf16-mixed"``).
        log_dir: Where ``stability.jsonl`` goes (default: ``stability_logs/version_<N>/``).
        tensorboard: A ``SummaryWriter``: the records as scalars, and TensorBoard's extras.
        fabric: A ``lightning.fabric.Fabric``: its backward, scaler, precision and loggers.
        options: The monitor's other settings, by name (`stabilizer.step.monitor.Options`:
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
        if clip is not None and not clip > 0:
            raise ValueError(f"`clip` must be > 0 or None, got {clip!r}")
        opts = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        self.policy = as_policy(policy)
        self.options = Options(**options | {"notify": as_notifier(options.get("notify"))})
        loggers: list[MetricsLogger] = [ScalarLogger(tensorboard)] if tensorboard else []
        setup, strategy = FabricSetup.of(fabric) if fabric is not None else None, "loop"
        self._backward = setup.backward if setup is not None else None
        if setup is not None:
            precision, scaler, strategy = setup.precision, setup.scaler, setup.strategy
            loggers, tensorboard = setup.loggers, tensorboard or setup.tensorboard
            log_dir = log_dir or setup.log_dir
        if precision is None:
            fp16 = scaler is not None and bool(scaler.is_enabled())
            precision = "16-mixed" if fp16 else "32-true"
        facts = loop_facts(model, precision, Path(log_dir) if log_dir else None, strategy)
        inner = [inner_optimizer(opt) for opt in opts]
        self.host = LoopHost(model, inner, schedulers, scaler, facts, clip)
        self._sinks = Sinks(loggers, 1, tensorboard)
        self.run: RunMonitor | None = None  # from the first step (after a resume's state)
        self._resumed: dict[str, Any] | None = None
        self._jsonl: Path | None = None  # the default JSONL of the run this one resumes
        self._index = 0  # micro-batches so far
        self._open = False  # inside a `step` block
        self.calls = ModelCalls(self.host.module, self._begin, self._wanted)
        self.host.calls = self.calls
        self._unscale = AfterUnscale(scaler, self._unscaled) if self.host.scaling else None
        self._closed = False

    # --- what the run shows ------------------------------------------------------------------

    @property
    def should_stop(self) -> bool:
        """The protection stopped the run (its bad steps in a row, or weights not intact)."""
        return self.host.should_stop

    # --- the loop's moments ------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One optimizer step (of every optimizer stepped inside), its micro-batches inside; a
        block in which no optimizer steps holds micro-batches of the next one."""
        run = self._start()
        self._open, self.calls.fresh = True, True
        try:
            yield
        finally:
            self._open = False
        stepped = bool(run.batch.steps)
        run.end()
        self.host.done += stepped
        self.host.early = False

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` (scaled by the fp16 scaler; Fabric's backward under Fabric), the
        loss noted first: under gradient accumulation, each micro-batch's share."""
        host, run = self.host, self.run
        scaled = host.scaler.scale(loss) if host.scaling else loss
        if run is not None and self._open and not run.inert:
            run.loss(scaled)
        self.calls.fresh = True  # the next call of the model begins a micro-batch
        if self._backward is not None:
            self._backward(loss, **kwargs)
        else:
            scaled.backward(**kwargs)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Measure `optimizer`'s coming step now: call it before your own clipping, so that
        ``grad_norm`` is the norm before it (otherwise it is measured inside the step)."""
        if self.run is not None and self._open:
            measure_once(self.run, inner_optimizer(optimizer))
            self.host.early = True

    def _unscaled(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer in self.host.optimizers:
            self.before_step(optimizer)

    def _begin(self, calls: list[Call]) -> None:
        if self.run is not None:
            self.run.begin(calls, self._index)
            self._index += 1

    def _wanted(self) -> bool:
        return self._open and self.run is not None and not self.run.inert

    def _start(self) -> RunMonitor:
        """The run's monitor, at the first step (after `load_state_dict`, if any)."""
        if self.run is None:
            self.run = RunMonitor(self.host, self.policy, self.options, self._sinks)
            earlier: list[Finding] = []
            if self._resumed is not None:
                self.run.load_state_dict(self._resumed)
                earlier = self.run.findings
            self.run.start(earlier)
            if self.run.guard is None:  # nothing measures inside the step: measured there
                self.host.at_step = self.before_step
        return self.run

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

    # --- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The monitor's state, for the loop's checkpoint (resume with `load_state_dict`)."""
        run = self._start()
        path = run.outputs.default_path or self._jsonl  # (a resumed run's: the one it resumed)
        return run.state_dict() | {"step": self.host.done, "jsonl": str(path) if path else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict`'s state: before the first step (a run in progress cannot
        take another's state); the default JSONL of the run it resumes goes on."""
        if self.run is not None:
            raise RuntimeError("`load_state_dict` must come before the first step")
        self._resumed, self.host.done = dict(state), int(state.get("step", 0))
        if state.get("jsonl") and self.options.jsonl is True:
            self._jsonl = Path(state["jsonl"])
            self.options = dataclasses.replace(self.options, jsonl=self._jsonl)
