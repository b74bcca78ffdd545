"""What ``stabilizer demo`` says after its run, beyond the monitor's own lines.

The demo is a user's first run: each line says something true of it that the user would
otherwise have to work out: that the device asked for is not there (one line, not a
traceback), and what the monitor did for a run with NaN steps (how to open TensorBoard from this
environment: `stabilizer.outputs.event_file.tensorboard_command`).
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as pl
import torch

from stabilizer.core.records import Finding
from stabilizer.outputs.findings_table import is_setup

__all__ = ["missing", "protect_line", "run_lines"]


def missing(device: str) -> str:
    """Why this machine cannot run on ``device`` (a ``--device`` choice); ``""`` when it can."""
    if device == "mps" and not torch.backends.mps.is_available():
        return "this machine has no Apple GPU (MPS): use --device cpu or auto"
    if device in ("cuda", "gpu") and not torch.cuda.is_available():
        return "this machine has no CUDA GPU: use --device cpu or auto"
    return ""


def protect_line(trainer: pl.Trainer, skipped: int, policy: str) -> str:
    """What the monitor's guard did for a run with non-finite steps (no grad scaler skipped
    them): it kept the weights finite, and the run trained on, or it stopped the run (as the
    Trainer tells: a stop asked for before its last step); ``""`` otherwise."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if not skipped or policy == "observe" or scaler is not None:
        return ""
    plural = "s" if skipped > 1 else ""
    went = f"protect: {skipped} step{plural} went NaN/Inf and the guard skipped "
    went += "them" if plural else "it"
    last = trainer.max_steps
    if trainer.should_stop and (last is None or last < 0 or trainer.global_step < last):
        return (
            f"{went}, then stopped the run at step {trainer.global_step}, its weights still "
            "finite: it was not recovering (--policy observe shows the same run without the guard)"
        )
    return (
        f"{went}: the weights stayed finite, so the run trained on "
        "(--policy observe shows the same run without the guard)"
    )


def run_lines(
    name: str,
    trainer: pl.Trainer,
    elapsed: float,
    skipped: int,
    policy: str,
    found: Sequence[Finding],
) -> list[str]:
    """The lines after a demo run: steps, time and losses; what the guard did (`protect_line`);
    the findings (``found``: one per episode, advised as the reports advise them) and, apart,
    the set-up notes (advice on the configuration, no event of the run)."""
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    device = trainer.accelerator.__class__.__name__.removesuffix("Accelerator").lower()
    lines = [
        f"{name}: {trainer.global_step} steps in {elapsed:.1f} s on {device}, "
        f"train loss {metrics.get('train/loss', float('nan')):.3f}, "
        f"val loss {metrics.get('val/loss', float('nan')):.3f}"
    ]
    lines += [why for why in [protect_line(trainer, skipped, policy)] if why]
    episodes = [finding for finding in found if not is_setup(finding)]
    lines += [f"findings: {len(episodes) or 'none'}", *(f"  {f}" for f in episodes)]
    setup = [finding for finding in found if is_setup(finding)]
    if setup:
        lines += [f"set-up notes: {len(setup)}", *(f"  {f}" for f in setup)]
    return lines
