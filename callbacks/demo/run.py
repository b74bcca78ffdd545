"""Build a real Lightning ``Trainer`` for a scenario and run it."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger, TensorBoardLogger
from lightning.pytorch.plugins.precision import MixedPrecision

from stabilizer.demo.model import GPT
from stabilizer.demo.scenarios import Scenario, get_scenario

from .datamodule import StabilizerDataModule
from .faults import FaultInjector
from .lit_gpt import LitGPT

__all__ = [
    "ScenarioRun",
    "cpu_threads",
    "precision_args",
    "quiet_lightning",
    "resolve_accelerator",
    "run_scenario",
    "sample_text",
]


def resolve_accelerator(accelerator: str) -> str:
    """``auto`` → ``cuda`` when a GPU is visible, else ``cpu``; other values pass through."""
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return accelerator


def cpu_threads(accelerator: str) -> str:
    """One torch thread for a demo on the CPU, unless ``OMP_NUM_THREADS`` chose; the line that
    says so (``""``: nothing set). The reference GPT's step is too small to gain from threads,
    and on a CPU other jobs keep busy the intra-op pool slows each step down tenfold or more
    (40 steps of ``healthy``: 100 s with the default threads at a load of 10, 8 s with one)."""
    if resolve_accelerator(accelerator) != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return ""
    torch.set_num_threads(1)
    return (
        "cpu: 1 torch thread (a model this small gains nothing from more, and a busy CPU's "
        "thread pool slows it down; OMP_NUM_THREADS=N sets N)"
    )


def precision_args(precision: str, accelerator: str) -> dict[str, Any]:
    """Trainer keyword arguments for one of ``stabilizer.demo.scenarios.PRECISIONS``.

    ``fp16`` means 16-bit mixed precision *with* a dynamic loss scaler everywhere. On CPU,
    Lightning silently turns ``precision="16-mixed"`` into bf16 without a scaler, so there we pass
    the precision plugin with a CPU ``GradScaler`` explicitly.
    """
    if precision == "fp16":
        device = resolve_accelerator(accelerator)
        if device == "cpu":
            scaler = torch.amp.GradScaler("cpu")
            return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
        return {"precision": "16-mixed"}
    return {"precision": precision}


@dataclass
class ScenarioRun:
    """A finished run: the trainer (``callback_metrics``, ``log_dir``) and its modules."""

    scenario: Scenario
    trainer: pl.Trainer
    module: LitGPT
    datamodule: StabilizerDataModule


def run_scenario(
    scenario: Scenario | str,
    *,
    steps: int | None = None,
    accelerator: str = "auto",
    callbacks: Sequence[pl.Callback] = (),
    logger: Logger | bool = False,
    log_dir: str | Path = "runs",
    data: str | Path | None = None,
    cache_dir: str | Path | None = None,
    progress: bool = False,
    validate: bool = True,
    module_class: type[LitGPT] = LitGPT,
    trainer_args: Mapping[str, Any] | None = None,
    ckpt_path: str | Path | None = None,
    name: str | None = None,
) -> ScenarioRun:
    """Train the reference GPT through ``scenario`` with a real Lightning ``Trainer``.

    Args:
        scenario: A :class:`Scenario` or the name of a preset.
        steps: Override the scenario's number of steps (faults keep their step numbers).
        accelerator: Lightning accelerator (``auto`` uses the GPU when there is one).
        callbacks: Extra callbacks (e.g. ``StabilityMonitor()``).
        logger: A Lightning logger, ``True`` for TensorBoard under ``log_dir``, ``False`` for none.
        log_dir: Root of the TensorBoard logs when ``logger`` is ``True``.
        data: Train on this text file instead of the stdlib corpus.
        cache_dir: Corpus cache location.
        progress: Show Lightning's progress bar.
        validate: Run validation once at the end of training.
        module_class: ``LitGPT`` or a subclass with another model (same optimizer, schedule).
        trainer_args: ``Trainer`` arguments that override the defaults (``devices``,
            ``strategy``, ``enable_checkpointing``, ...).
        ckpt_path: Resume from this Lightning checkpoint.
        name: The TensorBoard run's name under ``log_dir`` (default: the scenario's).
    """
    sc = get_scenario(scenario) if isinstance(scenario, str) else scenario
    if steps is not None:
        sc = sc.with_steps(steps)
    pl.seed_everything(sc.seed, verbose=False)
    module = module_class(
        sc.model,
        lr=sc.lr,
        weight_decay=sc.weight_decay,
        eps=sc.adam_eps,
        optimizer=sc.optimizer,
        momentum=sc.momentum,
        warmup_steps=sc.warmup_steps,
        max_steps=sc.steps,
    )
    corrupt = sc.corrupted() or None
    datamodule = StabilizerDataModule(
        block_size=sc.model.block_size,
        batch_size=sc.batch_size,
        max_steps=sc.steps,
        data=data,
        cache_dir=cache_dir,
        seed=sc.seed,
        corrupt=corrupt,
        corrupt_fill=sc.corrupt_fill,
    )
    if logger is True:
        logger = TensorBoardLogger(save_dir=str(log_dir), name=name or sc.name)
    faults = [FaultInjector(sc.lr_surge, sc.activation_fault, sc.lr_surge_until)]
    args: dict[str, Any] = {
        "accelerator": accelerator,
        "devices": 1,
        "max_steps": sc.steps,
        "max_epochs": 1,
        "callbacks": [*faults, *callbacks],
        "logger": logger,
        "log_every_n_steps": 1,
        "enable_checkpointing": False,
        "enable_progress_bar": progress,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 1.0 if validate else 0,
        "deterministic": False,
        **precision_args(sc.precision, accelerator),
        **(trainer_args or {}),
    }
    trainer = pl.Trainer(**args)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    return ScenarioRun(sc, trainer, module, datamodule)


def sample_text(model: GPT, decode: Callable[[list[int]], str], n: int) -> str:
    """``n`` bytes the model writes after ``"def "`` (seeded: the same text every time)."""
    model.eval()
    device = next(model.parameters()).device
    prompt = torch.tensor([list(b"def ")], device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    out = model.generate(prompt, n, temperature=0.8, top_k=40, generator=gen)
    return decode(out[0].tolist())


def quiet_lightning() -> None:
    """Hide Lightning's banners and tips: the demo prints its own summary."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*litlogger.*")
    # torch deprecates what Lightning's own pytree helper calls: no concern of a demo's user,
    # and it printed between the monitor's lines
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")
