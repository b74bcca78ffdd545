"""The zoo's harness: one small LightningModule around any model, a real ``Trainer`` run, what it
left behind, and a readable account of it.

A `Case` is a model as its own users write and train it; the harness wraps it in `ZooModule`,
trains it `STEPS` steps with AdamW on deterministic data (seeded init, seeded dropout) and keeps
an `Outcome`: every parameter, buffer and optimizer-state tensor at the end, the monitor's
findings and its log lines. A run is made once per session and shared by every assertion on it
(`outcome`), so the healthy runs, their no-monitor twin and the injected run are trained once.
"""

from __future__ import annotations

import json
import logging
import math
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from zoo_tensors import differences, held

from stabilizer.callbacks.monitor import StabilityMonitor
from stabilizer.core.records import Finding, Severity
from stabilizer.step.policies import Protect

__all__ = [
    "FAULT",
    "STEPS",
    "Batch",
    "Case",
    "Outcome",
    "ZooModule",
    "outcome",
]

STEPS = 20  # optimizer steps per run (one epoch of STEPS batches)
FAULT = 10  # the batch whose chosen module outputs NaN in the injected run

Batch = dict[str, Tensor]


@dataclass(frozen=True)
class Case:
    """A model nobody here designed, trained the way its own users train it.

    Args:
        name: The id in the test table.
        build: Builds the model with random weights (called under ``torch.manual_seed(0)``).
        batches: `STEPS` batches, drawn from the generator it is given (seeded).
        loss: The training loss of ``model`` on a batch.
        fault: The module (its name inside the model) whose output turns NaN at batch `FAULT`.
        after_step: What the user's module does after each batch (an EMA update), or None.
        lr: AdamW's learning rate.
        recipe: ``"adamw"``: AdamW at a constant LR, no clipping. ``"hf"``: the Hugging Face
            Trainer's (AdamW with weight decay but none on biases and norms, the LR decaying
            linearly to 0 each step, gradients clipped to norm 1.0).
    """

    name: str
    build: Callable[[], nn.Module]
    batches: Callable[[torch.Generator], list[Batch]]
    loss: Callable[[nn.Module, Batch], Tensor]
    fault: str
    after_step: Callable[[nn.Module], None] | None = None
    lr: float = 1e-3
    recipe: str = "adamw"


class ZooModule(pl.LightningModule):
    """The plain LightningModule a user writes around a model: ``forward`` is the model's, the
    loss in ``training_step``, AdamW over the trainable parameters, a ``DataLoader`` of ready
    batches.

    With ``fault_at`` a forward hook multiplies the output of ``case.fault`` by NaN at that
    batch (in training mode: the replay of that batch reproduces it, as a real overflow would).
    """

    def __init__(self, case: Case, fault_at: int | None = None) -> None:
        super().__init__()
        self.case, self.fault_at, self.batch_index = case, fault_at, -1
        torch.manual_seed(0)
        self.model = case.build()
        if fault_at is not None:
            self.model.get_submodule(case.fault).register_forward_hook(self._fault)

    def _fault(self, module: nn.Module, args: Any, out: Any) -> Any:
        if module.training and self.batch_index == self.fault_at:
            return _poison(out)
        return None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        self.batch_index = batch_idx
        return self.case.loss(self.model, batch)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.case.after_step is not None:
            self.case.after_step(self.model)

    def configure_optimizers(self) -> Any:
        trainable = [p for p in self.parameters() if p.requires_grad]
        if self.case.recipe == "adamw":
            return torch.optim.AdamW(trainable, lr=self.case.lr)
        groups = [
            {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": 0.01},
            {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW(groups, lr=self.case.lr)
        decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / STEPS)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": decay, "interval": "step"}}

    def train_dataloader(self) -> DataLoader[Batch]:
        batches = self.case.batches(torch.Generator().manual_seed(1))
        return DataLoader(batches, batch_size=None)  # type: ignore[arg-type]


def _poison(out: Any) -> Any:
    """``out`` times NaN: a tensor, or the first tensor of a tuple (attention modules)."""
    if isinstance(out, Tensor):
        return out * math.nan
    if isinstance(out, tuple) and out and isinstance(out[0], Tensor):
        return (out[0] * math.nan, *out[1:])
    raise TypeError(f"the fault module's output must be a tensor or a tuple, got {type(out)}")


class Witness(pl.Callback):
    """Copies everything the run holds before batch ``at`` and compares it after that step."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.before: dict[str, Tensor] = {}
        self.changed: list[str] | None = None  # None: the step was never seen

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, i: int) -> None:
        if i == self.at:
            self.before = held(module, trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
        if self.before and self.changed is None:
            self.changed = differences(self.before, held(module, trainer))


@dataclass
class Outcome:
    """What one run left: the tensors at the start and the end, the monitor's word, the stop."""

    label: str
    start: dict[str, Tensor]
    end: dict[str, Tensor]
    steps: int
    stopped: bool
    findings: list[Finding] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    skipped: int = 0
    witness: Witness | None = None
    module: ZooModule | None = None
    error: str | None = None  # the exception that ended the fit, and where it was raised
    measured: int = 0  # steps the monitor's JSONL holds with a finite loss

    def loud(self) -> list[Finding]:
        """The findings at WARNING or above."""
        return [f for f in self.findings if f.severity >= Severity.WARNING]

    def account(self) -> str:
        """Steps, stop, every finding at WARNING or above, and the monitor's stop lines."""
        said = [f"{self.label}: {self.steps}/{STEPS} steps, stopped={self.stopped}"]
        said += [f"  raised: {self.error}"] if self.error else []
        said += [f"  finding: {f}" for f in self.loud()]
        said += [f"  log: {line}" for line in self.lines if "stop" in line.lower()]
        said += [f"  log: {line}" for line in self.lines if line.startswith("StabilityMonitor")]
        return "\n".join(said)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def _captured() -> Iterator[list[str]]:
    """The stabilizer logger's lines (INFO and up) while the block runs; warnings silenced."""
    handler, log = _Lines(), logging.getLogger("stabilizer")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield handler.lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def _trainer(case: Case, root: Path, callbacks: list[pl.Callback]) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, max_epochs=1, callbacks=callbacks,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root,
        gradient_clip_val=1.0 if case.recipe == "hf" else None,
    )  # fmt: skip


def train(
    case: Case, policy: str | None, fault: bool, root: Path, root_cause: bool = True
) -> Outcome:
    """One real fit: ``policy`` None trains without the monitor."""
    monitor = None
    if policy is not None:
        jsonl = root / "stability.jsonl"
        chosen = Protect(root_cause=root_cause) if policy == "protect" else policy
        monitor = StabilityMonitor(policy=chosen, jsonl=jsonl)
    witness = Witness(FAULT) if fault else None
    label = f"{case.name} under {policy or 'no monitor'}" + (" with a NaN" if fault else "")
    label += "" if root_cause else " (root_cause=False)"
    error = None
    with _captured() as lines:  # (also the models' own warnings: QAT's deprecation)
        module = ZooModule(case, FAULT if fault else None)
        trainer = _trainer(case, root, [c for c in (witness, monitor) if c is not None])
        start = held(module, trainer)
        torch.manual_seed(2)  # dropout draws the same masks in every run of this case
        try:
            trainer.fit(module)
        except Exception as e:  # said in the failure of every assertion on this run
            error = _raised(e)
    return Outcome(
        label, start, held(module, trainer), trainer.global_step, trainer.should_stop,
        list(monitor.findings) if monitor else [], lines,
        monitor.skipped_steps if monitor else 0, witness, module, error,
        _measured(root / "stability.jsonl"),
    )  # fmt: skip


def _measured(jsonl: Path) -> int:
    """The steps the monitor's JSONL records with a finite loss (0 without the file)."""
    if not jsonl.exists():
        return 0
    records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    losses = [r["values"].get("loss") for r in records if r.get("type") == "step"]
    return sum(isinstance(x, float) and math.isfinite(x) for x in losses)


def _raised(e: BaseException) -> str:
    """``RuntimeError: ... (raised at step/weights.py:250 in end)``, with the deepest frame of
    the project's code on the way when the exception came from elsewhere."""
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if "/callbacks/" in f.filename or "/stabilizer/" in f.filename]
    said = f"{type(e).__name__}: {e} (raised at {_where(frames[-1])}"
    if ours and ours[-1] is not frames[-1]:
        said += f", through {_where(ours[-1])}"
    return said + ")"


def _where(frame: traceback.FrameSummary) -> str:
    return f"{'/'.join(Path(frame.filename).parts[-2:])}:{frame.lineno} in {frame.name}"


_RUNS: dict[tuple[str, str, bool, int, bool], Outcome] = {}


def outcome(
    case: Case,
    policy: str | None,
    root: Path,
    fault: bool = False,
    twin: int = 0,
    root_cause: bool = True,
) -> Outcome:
    """The run of ``case`` under ``policy``, trained once per session (``twin`` 1 is a second,
    identical run; ``root_cause=False`` the monitor's without its replay)."""
    key = (case.name, str(policy), fault, twin, root_cause)
    if key not in _RUNS:
        folder = root / "-".join(map(str, key))
        folder.mkdir(parents=True, exist_ok=True)
        _RUNS[key] = train(case, policy, fault, folder, root_cause)
    return _RUNS[key]
