"""``StabilityCallback``: the step in a Hugging Face ``Trainer`` — one callback in its list.

    trainer = Trainer(model, args, train_dataset=..., callbacks=[StabilityCallback()])

A ``TrainerCallback`` cannot veto a step, so the guard goes on the optimizer the Trainer steps:
on the torch optimizer inside accelerate's ``AcceleratedOptimizer``, which accelerate calls once
per optimizer step (after the gradient accumulation; under fp16, inside its grad scaler), so
the decision is taken at the last moment there, as under Lightning. The model's forward hooks
note each micro-batch's inputs (for a replay) and its loss (HF models return ``.loss`` when
given labels; a ``compute_loss`` of your own that computes it from the logits leaves the step
without a loss, judged on its gradients). The step is measured when the last micro-batch's
backward is over (under fp16: when the scaler unscales), before HF clips it, so ``grad_norm``
is the norm before clipping, like HF's own logged ``grad_norm``, which stays as it is.

``stability.jsonl`` goes to ``args.output_dir``; with ``report_to`` naming ``tensorboard``, the
records and TensorBoard's extras go to ``args.logging_dir`` (or ``$TENSORBOARD_LOGGING_DIR``, or
``<output_dir>/runs/stability``). Needs the ``hf`` extra (``transformers``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from accelerate.state import GradientState
from transformers import TrainerCallback

from stabilizer.outputs.notify import as_notifier
from stabilizer.step.live_outputs import Sinks
from stabilizer.step.monitor import Options, RunMonitor, RunView
from stabilizer.step.policies import Policy, as_policy

from .calls import Call, ModelCalls, given_loss
from .hf_host import HFHost
from .moments import AfterUnscale, after_backward, measure_once
from .scalars import ScalarLogger

__all__ = ["StabilityCallback"]


class StabilityCallback(RunView, TrainerCallback):
    """The step in a ``Trainer`` (see the module).

    Args:
        policy: ``Protect(...)`` (default), ``Observe()``, ``Auto(...)``, or a name.
        tensorboard: A ``SummaryWriter`` of your own for the records and TensorBoard's extras
            (default: one of ours, when ``report_to`` names ``tensorboard``).
        options: The monitor's other settings, by name (`stabilizer.step.monitor.Options`:
            detectors, grouping, activation_every, heatmap_every, jsonl, strict, preflight,
            notify, cost_budget).
    """

    def __init__(
        self, policy: str | Policy = "protect", *, tensorboard: Any = None, **options: Any
    ) -> None:
        self.policy = as_policy(policy)
        self.options = Options(**options | {"notify": as_notifier(options.get("notify"))})
        self.tensorboard = tensorboard
        self.run: RunMonitor | None = None  # this training's
        self.host: HFHost | None = None
        self._parts: list[Any] = []  # hooks and writers to remove or close at the end
        self._open = False  # inside a step
        self._index = 0  # micro-batches so far

    # --- the Trainer's events ------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._parts and self.run is not None:  # the last training died (HF has no event)
            self.run.abort()
            self._release()
        host = HFHost(
            args, state, kwargs["model"], kwargs["optimizer"], kwargs.get("lr_scheduler"),
            kwargs.get("train_dataloader"),
        )  # fmt: skip
        writer = self.tensorboard or _writer(args, host)
        every = max(1, int(getattr(state, "logging_steps", 1) or 1))
        sinks = Sinks([ScalarLogger(writer)] if writer else [], every, writer)
        self.host, self.run = host, RunMonitor(host, self.policy, self.options, sinks)
        host.rewire()  # accelerate's fp16 path calls the guarded step
        host.calls = ModelCalls(host.model, self._begin, self._wanted, self._returned)
        self._parts = [host.calls, writer if writer is not self.tensorboard else None]
        if host.scaler is not None and host.scaler.is_enabled():
            self._parts.append(AfterUnscale(host.scaler, self._measure))
        if state.global_step > 0:  # a resumed training was checked when it started
            self.run.preflight.done = True
        self.run.start()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.host is not None and self.host.calls is not None:
            self.host.current, self._open = int(state.global_step), True
            self.host.calls.fresh = True

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.host is not None and self.host.calls is not None:
            self.host.calls.fresh = True  # the next call of the model is the next micro-batch

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        host, run = self.host, self.run
        if host is None or run is None:
            return
        self._open = False
        run.end()
        host.current = int(state.global_step)
        if host.should_stop:
            control.should_training_stop = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.host is not None:  # the Trainer's own name for it
            self.host.saved = str(Path(args.output_dir) / f"checkpoint-{state.global_step}")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        run, host = self.run, self.host
        if run is None or host is None:
            return
        try:
            run.finish()
        finally:
            self._release()

    def _release(self) -> None:
        """The optimizer's own step again, the model's hooks removed, our writer closed."""
        if self.run is not None:
            self.run.release()
        if self.host is not None:
            self.host.rewire()
        for part in self._parts:
            if isinstance(part, ModelCalls | AfterUnscale):
                part.remove()
            elif part is not None:
                part.close()
        self._parts, self._open = [], False

    # --- the model's calls ---------------------------------------------------------------------

    def _wanted(self) -> bool:
        return self._open and self.run is not None and not self.run.inert

    def _begin(self, calls: list[Call]) -> None:
        if self.run is not None:
            self.run.begin(calls, self._index)
            self._index += 1

    def _returned(self, output: Any, kwargs: dict[str, Any]) -> None:
        """A micro-batch's output: its loss noted (its share of the step's), and, at the last
        micro-batch of a step, the step measured when its backward is over."""
        host, run = self.host, self.run
        if host is None or run is None:
            return
        loss = given_loss(output)
        if loss is not None:
            noted = loss * self._share(kwargs)
            scaler = host.scaler
            run.loss(scaler.scale(noted) if scaler is not None and scaler.is_enabled() else noted)
        through = loss if loss is not None else _first_grad_tensor(output)
        fp16 = host.scaler is not None and host.scaler.is_enabled()
        if through is not None and not fp16 and GradientState().sync_gradients:
            after_backward(through, lambda: self._measure(host.optimizer))

    def _share(self, kwargs: dict[str, Any]) -> float:
        """The loss's factor in the step's: HF divides a micro-batch's mean by the
        accumulation, unless the model took ``num_items_in_batch`` (its loss is then the share
        of the accumulated batch already, times the ranks when averaged over their tokens)."""
        assert self.host is not None
        args = self.host.args
        if kwargs.get("num_items_in_batch") is None:
            return 1.0 / max(1, int(args.gradient_accumulation_steps))
        world = self.host.ranks.world_size
        return float(world) if getattr(args, "average_tokens_across_devices", False) else 1.0

    def _measure(self, optimizer: torch.optim.Optimizer) -> None:
        host, run = self.host, self.run
        if run is not None and self._open and host is not None and optimizer is host.optimizer:
            measure_once(run, optimizer)


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    """The first tensor in a model's output that carries a gradient (its logits)."""
    values = output.values() if isinstance(output, dict) else output
    if isinstance(values, torch.Tensor):
        return values if values.requires_grad else None
    for value in values if isinstance(values, tuple | list) else list(values):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return value
    return None


def _writer(args: Any, host: HFHost) -> Any:
    """A ``SummaryWriter`` of ours when ``report_to`` names TensorBoard (rank 0), else None."""
    report = args.report_to if isinstance(args.report_to, list) else [args.report_to]
    if "tensorboard" not in report or not host.facts.is_global_zero:
        return None
    from torch.utils.tensorboard import SummaryWriter

    logging_dir = getattr(args, "logging_dir", None) or os.environ.get("TENSORBOARD_LOGGING_DIR")
    return SummaryWriter(logging_dir or str(Path(args.output_dir) / "runs" / "stability"))
