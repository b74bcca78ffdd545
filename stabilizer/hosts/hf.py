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
``<output_dir>/runs/stability``). The monitor's state rides in each checkpoint's
``trainer_state.json`` (HF's ``ExportableState``): ``train(resume_from_checkpoint=...)`` goes on
as the run it resumes. Needs the ``hf`` extra (``transformers``).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate.state import GradientState
from torch import nn
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from stabilizer.step.host import HostFacts
from stabilizer.step.live_outputs import Sinks
from stabilizer.step.monitor import RunMonitor
from stabilizer.step.options import options_from
from stabilizer.step.policies import Policy, as_policy
from stabilizer.step.ranks import Ranks
from stabilizer.step.view import RunView

from .calls import Call, ModelCalls, ReplaysCalls, given_loss
from .loop import inner_optimizer
from .moments import AfterUnscale, after_backward
from .precision import weights_precision
from .scalars import ScalarLogger

__all__ = ["HFHost", "StabilityCallback", "hf_precision"]


class StabilityCallback(RunView, TrainerCallback, ExportableState):
    """The step in a ``Trainer`` (see the module).

    Args:
        policy: ``Protect(...)`` (default), ``Observe()``, ``Auto(...)``, or a name.
        tensorboard: A ``SummaryWriter`` of your own for the records and TensorBoard's extras
            (default: one of ours, when ``report_to`` names ``tensorboard``).
        options: The monitor's other settings, by name (`stabilizer.step.options.Options`:
            detectors, grouping, activation_every, heatmap_every, jsonl, strict, preflight,
            notify, cost_budget).
    """

    def __init__(
        self, policy: str | Policy = "protect", *, tensorboard: Any = None, **options: Any
    ) -> None:
        self.policy = as_policy(policy)
        self.options = options_from(options)
        self.tensorboard = tensorboard
        self.run: RunMonitor | None = None  # this training's
        self.host: HFHost | None = None
        self.monitor_state: dict[str, Any] | None = None  # a checkpoint's (HF restores it here)
        self._parts: list[Any] = []  # hooks and writers to remove or close at the end
        self._open = False  # inside a step
        self._index = 0  # micro-batches so far

    def state(self) -> dict[str, Any]:
        """What HF's checkpoint keeps of the callback (``trainer_state.json``): the run's
        state (`RunMonitor.state_dict`), plain JSON."""
        run = self.run
        return {"args": {}, "attributes": {"monitor_state": run.state_dict() if run else None}}

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
        resumed = _resumed(state, self.monitor_state) if state.global_step > 0 else None
        self.host, self.monitor_state = host, None
        self.run = RunMonitor(host, self.policy, self.options, sinks, resumed)
        host.rewire()  # accelerate's fp16 path calls the guarded step
        calls = ModelCalls(host.model, self._begin, self._wanted, self._returned)
        host.replays_with(calls)
        self._parts = [calls, writer if writer is not self.tensorboard else None]
        if host.scaler is not None:
            self._parts.append(AfterUnscale(host.scaler, self._measure))
        self.run.start()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.host is not None:
            self.host.at(int(state.global_step))
            self._open = True
            self.host.new_micro_batch()

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.host is not None:  # the next call of the model is the next micro-batch
            self.host.new_micro_batch()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        host, run = self.host, self.run
        if host is None or run is None:
            return
        self._open = False
        run.end()
        host.at(int(state.global_step))
        if run.should_stop:
            control.should_training_stop = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.host is not None:  # the Trainer's own name for it
            self.host.saved(str(Path(args.output_dir) / f"checkpoint-{state.global_step}"))

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
            run.loss(scaler.scale(noted) if scaler is not None else noted)
        through = loss if loss is not None else _first_grad_tensor(output)
        if through is not None and host.scaler is None and GradientState().sync_gradients:
            after_backward(through, lambda: self._measure(host.optimizer))

    def _share(self, kwargs: dict[str, Any]) -> float:
        """The loss's factor in the step's: HF divides a micro-batch's mean by the
        accumulation, unless the model took ``num_items_in_batch`` (its loss is then the share
        of the accumulated batch already, times the ranks when averaged over their tokens)."""
        assert self.host is not None
        args = self.host.args
        if kwargs.get("num_items_in_batch") is None:
            return 1.0 / max(1, int(args.gradient_accumulation_steps))
        world = self.host.facts.world_size
        return float(world) if getattr(args, "average_tokens_across_devices", False) else 1.0

    def _measure(self, optimizer: torch.optim.Optimizer) -> None:
        host, run = self.host, self.run
        if run is not None and self._open and host is not None and optimizer is host.optimizer:
            run.before_step(optimizer)


def _resumed(state: Any, restored: dict[str, Any] | None) -> dict[str, Any] | None:
    """The monitor's state in the checkpoint the Trainer resumed (HF keeps it in
    ``state.stateful_callbacks``; with ``restore_callback_states_from_checkpoint`` it sets it on
    the callback instead)."""
    if restored:
        return restored
    kept = getattr(state, "stateful_callbacks", None) or {}
    saved = kept.get(StabilityCallback.__name__) if isinstance(kept, dict) else None
    saved = saved[0] if isinstance(saved, list) and saved else saved
    attributes = saved.get("attributes") if isinstance(saved, dict) else None
    found = attributes.get("monitor_state") if isinstance(attributes, dict) else None
    return found if isinstance(found, dict) else None


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


def hf_precision(args: Any, model: nn.Module | None = None) -> str:
    """The ``TrainingArguments``' precision in Lightning's names; without ``fp16``/``bf16``,
    the `model`'s weights' (one loaded in bf16 trains in bf16: ``"bf16-true"``)."""
    if getattr(args, "fp16", False):
        return "16-mixed"
    if getattr(args, "bf16", False):
        return "bf16-mixed"
    return weights_precision(model) if model is not None else "32-true"


class HFHost(ReplaysCalls):
    """A ``Trainer``'s training as the step's host (`stabilizer.step.host.Host`): what only the
    Trainer knows, from the ``TrainingArguments``, the ``TrainerState`` and what its events hand
    over. The optimizer the Trainer steps is accelerate's ``AcceleratedOptimizer``; the guard
    goes on the torch optimizer inside it. HF's own clipping (``max_grad_norm``, read at every
    step) is the host's clipping; a root cause replays the model's recorded calls
    (`stabilizer.hosts.calls.ModelCalls`).

    Args:
        args: The ``TrainingArguments``.
        state: The ``TrainerState`` (its ``global_step``).
        model: The model the Trainer trains (unwrapped: the callbacks' ``model``).
        optimizer: The optimizer the Trainer steps (accelerate's wrapper, or a torch one).
        scheduler: The LR scheduler, if any.
        data: The training dataloader, if handed over.
    """

    recount = False  # torch's version counters tell when code wrote the gradients since

    def __init__(
        self, args: Any, state: Any, model: nn.Module, optimizer: Any, scheduler: Any, data: Any
    ) -> None:
        self.args, self.model, self.module = args, model, model
        self.wrapper, self.optimizer = optimizer, inner_optimizer(optimizer)
        self.scheduler, self.data = scheduler, data  # (the dataloader)
        scaler = getattr(optimizer, "scaler", None)  # accelerate's, under fp16
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.step = int(state.global_step)  # the step in flight (HF counts it up before its
        self.checkpoint = ""  # on_step_end, where the monitor reports it); the last saved
        ranks = Ranks.current()
        device = getattr(args, "device", torch.device("cpu"))
        self.facts = HostFacts(
            precision=hf_precision(args, model), accelerator=device.type, devices=1,
            strategy="hf_trainer", world_size=ranks.world_size, rank=ranks.rank,
            log_dir=Path(args.output_dir),
        )  # fmt: skip

    @property
    def optimizers(self) -> Sequence[torch.optim.Optimizer]:
        return [self.optimizer]

    @property
    def schedulers(self) -> Sequence[Any]:
        return [self.scheduler] if self.scheduler is not None else []

    @property
    def clip(self) -> float | None:
        value = getattr(self.args, "max_grad_norm", None)
        return float(value) if value and math.isfinite(value) else None

    def set_clip(self, value: float) -> None:
        self.args.max_grad_norm = value  # the Trainer reads it at every step

    def at(self, step: int) -> None:
        """The Trainer's step now (HF counts it up before its ``on_step_end``)."""
        self.step = step

    def saved(self, path: str) -> None:
        """The Trainer saved a checkpoint at `path`."""
        self.checkpoint = path

    def new_micro_batch(self) -> None:
        """The next call of the model begins a micro-batch."""
        if self._calls is not None:
            self._calls.fresh = True

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
