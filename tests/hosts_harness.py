"""One tiny training under each host the step runs in: a plain loop, Fabric, Lightning, HF.

A test states a `Setup` (the optimizer, an fp16 grad scaler, clipping, NaN steps, the policy,
the model's mode) and `train(host, setup, tmp_path)` runs it under that host with the host's
own front end (`Stabilizer`, `Stabilizer(fabric=...)`, `StabilityMonitor`, `StabilityCallback`),
returning what the step reported: the findings, the JSONL's records and end line, the console's
lines and the weights. The model returns its loss (as nanoGPT's and Hugging Face's do), so a
NaN made in it is made again when the root cause replays its calls. Every host trains on the
same batches in the same order; where nothing differs by design, to the same weights.
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

HOSTS = ("loop", "fabric", "lightning", "hf")
BATCH = 4

Make = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


@dataclass
class Setup:
    """One training's settings (the same under every host).

    Args:
        steps: Optimizer steps.
        nan_at: Steps whose model output is NaN (the model's own fault).
        optimizer: Makes the optimizer from the parameters.
        fp16: An fp16 grad scaler (a CPU ``torch.amp.GradScaler``) and fp16 autocast.
        clip: The host's gradient clipping (``clip=``, ``gradient_clip_val``, ``max_grad_norm``).
        policy: The monitor's policy.
        eval_mode: The model trains in ``eval()`` (frozen BatchNorm fine-tuning).
        dtype: The model's and the data's dtype.
        scale: The loss is multiplied by this at `scale_at` (a huge finite loss).
        options: The monitor's other options.
    """

    steps: int = 8
    nan_at: tuple[int, ...] = ()
    optimizer: Make = adamw
    fp16: bool = False
    clip: float | None = None
    policy: Any = "protect"
    eval_mode: bool = False
    dtype: torch.dtype = torch.float32
    scale: float = 1.0
    scale_at: int = -1
    options: dict[str, Any] = field(default_factory=dict)


class Tiny(nn.Module):
    """Linear → BatchNorm → ReLU → Linear; returns the loss. Its output is NaN at the steps of
    `nan_at` (read through `step`, which the host's runner points at its step counter)."""

    def __init__(self, setup: Setup) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.norm, self.b = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)
        self.setup = setup
        self.step: Callable[[], int] = lambda: 0
        self.to(setup.dtype)

    def forward(self, x: Tensor, labels: Tensor) -> Tensor:
        out = self.b(torch.relu(self.norm(self.a(x))))
        step = self.step()
        if step in self.setup.nan_at:
            out = out * math.nan
        wide = torch.promote_types(out.dtype, torch.float32)  # (fp16 autocast: the loss in fp32)
        loss = ((out.to(wide) - labels.to(wide)) ** 2).mean()
        return loss * self.setup.scale if step == self.setup.scale_at else loss


def batches(setup: Setup) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(0)
    n = setup.steps * BATCH
    x = torch.randn(n, 4, generator=g).to(setup.dtype)
    y = torch.randn(n, 1, generator=g).to(setup.dtype)
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, n, BATCH)]


@dataclass
class Result:
    """What one training reported."""

    findings: list[Any]
    rows: list[dict[str, Any]]  # the JSONL, line by line
    lines: list[str]  # the console's lines
    skipped: int  # the front end's `skipped_steps`
    model: Tiny
    front: Any  # the front end (`Stabilizer`, `StabilityMonitor`, `StabilityCallback`)

    @property
    def records(self) -> dict[int, dict[str, float]]:
        return {r["step"]: r["values"] for r in self.rows if r["type"] == "step"}

    @property
    def end(self) -> dict[str, Any]:
        (end,) = [r for r in self.rows if r["type"] == "end"][-1:]
        return end

    def kinds(self, *ignore: str) -> list[tuple[str, int]]:
        skip = {"config_risk", "nonfinite_held", *ignore}
        return [(f.kind, f.step) for f in self.findings if f.kind not in skip]

    def weights(self) -> list[Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def train(host: str, setup: Setup, tmp: Path, caplog: pytest.LogCaptureFixture) -> Result:
    """`setup` under `host`; the JSONL in `tmp`."""
    if host == "hf" and not os.environ.get("CI"):  # CI installs the hf extra
        pytest.importorskip("transformers")
    model = Tiny(setup)
    if setup.eval_mode:
        model.eval()
    run = {"loop": _loop, "fabric": _fabric, "lightning": _lightning, "hf": _hf}[host]
    jsonl = tmp / "stability.jsonl"
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="stabilizer"):
        warnings.simplefilter("ignore")
        front = run(model, setup, jsonl)
    lines = [r.getMessage() for r in caplog.records if r.name == "stabilizer"]
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    return Result(front.findings, rows, lines, front.skipped_steps, model, front)


def _autocast(setup: Setup) -> Any:
    return torch.autocast("cpu", torch.float16) if setup.fp16 else nullcontext()


def _loop(model: Tiny, setup: Setup, jsonl: Path) -> Any:
    from stabilizer.hosts.loop import Stabilizer

    optimizer = setup.optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu") if setup.fp16 else None
    at = {"step": 0}
    model.step = lambda: at["step"]
    stab = Stabilizer(
        model, optimizer, setup.policy, scaler=scaler, clip=setup.clip, jsonl=jsonl,
        **setup.options,
    )  # fmt: skip
    with stab:
        for i, (x, y) in enumerate(batches(setup)):
            at["step"] = i
            with stab.step():
                with _autocast(setup):
                    loss = model(x, y)
                stab.backward(loss)
                if scaler is not None:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad()
            if stab.should_stop:
                break
    return stab


def _fabric(model: Tiny, setup: Setup, jsonl: Path) -> Any:
    from lightning.fabric import Fabric
    from lightning.fabric.plugins import MixedPrecision

    from stabilizer.hosts.loop import Stabilizer

    plugins = [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))] if setup.fp16 else []
    precision = "64-true" if setup.dtype == torch.float64 else None
    fabric = Fabric(accelerator="cpu", devices=1, plugins=plugins, precision=precision)
    optimizer = setup.optimizer(model.parameters())
    wrapped, optimizer = fabric.setup(model, optimizer)
    at = {"step": 0}
    model.step = lambda: at["step"]
    stab = Stabilizer(
        wrapped, optimizer, setup.policy, clip=setup.clip, fabric=fabric, jsonl=jsonl,
        **setup.options,
    )  # fmt: skip
    with stab:
        for i, (x, y) in enumerate(batches(setup)):
            at["step"] = i
            with stab.step():
                stab.backward(wrapped(x, y))
                optimizer.step()
                optimizer.zero_grad()
            if stab.should_stop:
                break
    return stab


def _lightning(model: Tiny, setup: Setup, jsonl: Path) -> Any:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins import MixedPrecision
    from torch.utils.data import DataLoader

    from stabilizer.callbacks.monitor import StabilityMonitor

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if setup.eval_mode:
                self.model.eval()  # Lightning puts the module in train() at fit start

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            loss: Tensor = self.model(*batch)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return setup.optimizer(self.model.parameters())

    monitor = StabilityMonitor(setup.policy, jsonl=jsonl, **setup.options)
    plugins = [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))] if setup.fp16 else []
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=setup.steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor],
        gradient_clip_val=setup.clip, plugins=plugins,
        precision="64-true" if setup.dtype == torch.float64 else None,
    )  # fmt: skip
    model.step = lambda: trainer.global_step
    trainer.fit(Lit(), DataLoader(batches(setup), batch_size=None))
    return monitor


class Examples(torch.utils.data.IterableDataset[dict[str, Tensor]]):
    """The same batches, one example at a time, in order (the Trainer batches them again)."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        for x, y in batches(self.setup):
            yield from ({"x": a, "labels": b} for a, b in zip(x, y, strict=True))


def _hf(model: Tiny, setup: Setup, jsonl: Path) -> Any:
    from transformers import Trainer, TrainingArguments

    from stabilizer.hosts.hf import StabilityCallback

    args = TrainingArguments(
        output_dir=str(jsonl.parent / "hf"), max_steps=setup.steps,
        per_device_train_batch_size=BATCH, learning_rate=1e-2, lr_scheduler_type="constant",
        max_grad_norm=setup.clip or 0.0, report_to="none", save_strategy="no", use_cpu=True,
        disable_tqdm=True, logging_steps=1000, fp16=setup.fp16, dataloader_drop_last=True,
    )  # fmt: skip
    callback = StabilityCallback(setup.policy, jsonl=jsonl, **setup.options)
    optimizer = setup.optimizer(model.parameters())
    trainer = Trainer(
        model=HFModel(model), args=args, train_dataset=Examples(setup),
        optimizers=(optimizer, _hf_schedule(optimizer)), callbacks=[callback],
    )  # fmt: skip
    if setup.fp16:  # (accelerate keeps a CUDA scaler; on the CPU a CPU one stands in)
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
        trainer.accelerator.native_amp = True
    model.step = lambda: trainer.state.global_step
    trainer.train()
    return callback


def _hf_schedule(optimizer: torch.optim.Optimizer) -> Any:
    """HF's own schedule for an optimizer that computes its LR (``Adafactor(lr=None)``: the
    Trainer's default schedule would multiply its None), else None (the Trainer's)."""
    if optimizer.param_groups[0].get("lr") is not None:
        return None
    from transformers.optimization import AdafactorSchedule

    return AdafactorSchedule(optimizer)


class HFModel(nn.Module):
    """The tiny model as the ``Trainer`` calls one: keyword inputs, a dict with the loss."""

    def __init__(self, model: Tiny) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor, labels: Tensor) -> dict[str, Tensor]:
        return {"loss": self.model(x, labels)}


def hosts(*names: str) -> list[Any]:
    """pytest params over `names` (default: every host)."""
    return [pytest.param(name, id=name) for name in names or HOSTS]
