"""`StabilityCallback` in the Hugging Face ``Trainer`` beyond the parity scenario: accelerate's
fp16 path (its grad scaler around the optimizer), a ``compute_loss`` of the user's own, the
TensorBoard output. The model is the parity test's GPT behind HF's calling convention."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from test_hosts_parity import NAN_AT, Examples, HFWrapper, Scenario

if not os.environ.get("CI"):  # CI installs the hf extra: there a missing transformers fails
    pytest.importorskip("transformers")

from transformers import Trainer, TrainerCallback, TrainingArguments

from stabilizer.hosts.hf import StabilityCallback

STEPS = 14


def arguments(out: Path, **kwargs: Any) -> TrainingArguments:
    settings: dict[str, Any] = {
        "output_dir": str(out), "max_steps": STEPS, "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2, "learning_rate": 1e-3, "lr_scheduler_type": "constant",
        "report_to": "none", "save_strategy": "no", "use_cpu": True, "disable_tqdm": True,
        "logging_steps": 1000,
    }  # fmt: skip
    return TrainingArguments(**settings | kwargs)


def train(scenario: Scenario, trainer: Trainer) -> None:
    scenario.step = lambda: trainer.state.global_step
    trainer.train()


def steps_of(path: Path) -> dict[int, dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r["values"] for r in rows if r["type"] == "step"}


class BadLR(TrainerCallback):
    """An LR scheduler's bug: the LR is NaN at step `at` (the scheduler puts it back after)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.at:
            for group in kwargs["optimizer"].param_groups:
                group["lr"] = float("nan")


def test_accelerates_fp16_path_is_guarded(tmp_path: Path) -> None:
    """Under fp16 accelerate steps the optimizer through its grad scaler (on a GPU; here a CPU
    scaler stands where accelerate keeps its CUDA one): the NaN step the scaler skips is
    measured and named, a NaN LR the scaler cannot see is skipped by the guard, and at the end
    the optimizer, the scaler and accelerate's wrapper are as they were."""
    scenario = Scenario()
    callback = StabilityCallback(jsonl=tmp_path / "stability.jsonl")
    args = arguments(tmp_path, fp16=True, max_grad_norm=1.0)
    trainer = Trainer(
        model=HFWrapper(scenario.gpt), args=args, train_dataset=Examples(scenario.windows),
        optimizers=(scenario.optimizer(), None), callbacks=[BadLR(12), callback],
    )  # fmt: skip
    scaler = trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
    trainer.accelerator.native_amp = True
    train(scenario, trainer)
    values = steps_of(tmp_path / "stability.jsonl")
    assert values[NAN_AT]["skipped"] == 1.0 and values[NAN_AT]["loss_scale"] == 65536.0
    assert values[NAN_AT + 1]["loss_scale"] == 32768.0  # the scaler's own skip
    found = [(f.kind, f.step) for f in callback.findings]
    assert found == [("nonfinite_loss", NAN_AT), ("root_cause", NAN_AT), ("nonfinite_update", 12)]
    assert callback.skipped_steps == 2 and values[12]["skipped"] == 1.0
    weights = scenario.weights
    assert weights[NAN_AT] == weights[NAN_AT + 1] and weights[12] == weights[13]
    wrapper = trainer.optimizer  # (its `step` may be an LR scheduler's wrapper: not ours)
    step = wrapper.optimizer.step
    assert not hasattr(getattr(step, "__func__", step), "_stabilizer_guard")
    assert wrapper._optimizer_original_step_method == step  # accelerate calls it again
    assert "unscale_" not in scaler.__dict__


LOSS_BUG = 5


class OwnLoss(Trainer):
    """A ``compute_loss`` of the user's: the loss from the logits (the model returns none),
    and a bug in it at step `LOSS_BUG`."""

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        labels = inputs.pop("labels")
        logits = model(**inputs)["logits"]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return loss * float("nan") if self.state.global_step == LOSS_BUG else loss


def test_a_compute_loss_of_ones_own_and_tensorboard(tmp_path: Path) -> None:
    """Without the model's loss a step is judged on its gradients (a NaN is a
    ``nonfinite_grad``); the NaN of the loss code is not replayed, and its root cause says it
    came from outside the model, while the model's own NaN (step 10) is named as before; the
    records go to TensorBoard under ``stability/``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scenario = Scenario()
    callback = StabilityCallback(jsonl=tmp_path / "stability.jsonl")
    args = arguments(tmp_path, report_to=["tensorboard"], logging_steps=1)
    trainer = OwnLoss(
        model=HFWrapper(scenario.gpt), args=args, train_dataset=Examples(scenario.windows),
        optimizers=(scenario.optimizer(), None), callbacks=[callback],
    )  # fmt: skip
    train(scenario, trainer)
    found = [(f.kind, f.step, f.location) for f in callback.findings if f.kind == "root_cause"]
    assert found == [("root_cause", LOSS_BUG, ()), ("root_cause", NAN_AT, ("blocks.1.mlp",))]
    outside = callback.findings[1]
    assert outside.seen.startswith("the replay of the model's calls stayed finite: the NaN")
    assert [f.kind for f in callback.findings].count("nonfinite_grad") == 2
    values = steps_of(tmp_path / "stability.jsonl")
    assert "loss" not in values[0] and values[LOSS_BUG]["skipped"] == values[NAN_AT]["skipped"]
    assert callback.skipped_steps == 2
    assert scenario.weights[NAN_AT] == scenario.weights[NAN_AT + 1]
    # transformers 5 has no `logging_dir`: <output_dir>/runs/stability; 4.x: HF's own dir
    folders = {path.parent for path in (tmp_path / "runs").rglob("events.out.tfevents.*")}
    (ours,) = [folder for folder in folders if _has_ours(folder, EventAccumulator)]
    acc = EventAccumulator(str(ours), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("stability/grad_norm")] == list(range(STEPS))


def _has_ours(folder: Path, accumulator: Any) -> bool:
    acc = accumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return "stability/grad_norm" in acc.Tags()["scalars"]


class Crash(TrainerCallback):
    """The training dies at step `at` (an error in the user's code; HF has no event for it)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.at:
            raise RuntimeError("the user's bug")


def test_a_training_that_died_is_released_when_the_callback_trains_again(tmp_path: Path) -> None:
    """A second ``train()`` after a crash (a notebook's next cell) starts clean: the dead
    training's optimizer is no longer guarded, its hooks are off the model (none twice), and
    the new training's findings are its own."""
    scenario = Scenario()
    model = HFWrapper(scenario.gpt)
    hooks = {m: (len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()}
    callback = StabilityCallback(jsonl=False)
    first = Trainer(
        model=model, args=arguments(tmp_path / "a"), train_dataset=Examples(scenario.windows),
        optimizers=(scenario.optimizer(), None), callbacks=[Crash(3), callback],
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="the user's bug"):
        train(scenario, first)
    dead = first.optimizer.optimizer
    second = Trainer(
        model=model, args=arguments(tmp_path / "b"), train_dataset=Examples(scenario.windows),
        optimizers=(scenario.optimizer(), None), callbacks=[callback],
    )  # fmt: skip
    train(scenario, second)
    step = dead.step
    assert not hasattr(getattr(step, "__func__", step), "_stabilizer_guard")
    assert {m: (len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()} == hooks
    assert [(f.kind, f.step) for f in callback.findings if f.kind == "nonfinite_loss"] == [
        ("nonfinite_loss", NAN_AT)
    ]  # once: the second training's
