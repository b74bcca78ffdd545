"""Resume: detector and monitor state ride in the Lightning checkpoint.

A run stopped at step N and resumed from its checkpoint reports the same findings as the same run
uninterrupted — here a NaN episode that spans the checkpoint and turns persistent after it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from test_protect import Fault, tiny

from stabilizer.callbacks.demo.run import run_scenario
from stabilizer.callbacks.monitor import StabilityMonitor
from stabilizer.core.records import Finding
from stabilizer.step.policies import Protect

STEPS, SAVE_AT = 16, 8


class Window(Fault):
    """NaN activations on steps 6..11: five in a row make the episode persistent at step 10."""

    def _active(self, trainer: pl.Trainer) -> bool:
        return 6 <= trainer.global_step < 12


def run(tmp: Path, monitor: StabilityMonitor, ckpt: Path | None = None) -> list[Finding]:
    save = ModelCheckpoint(dirpath=tmp, every_n_train_steps=SAVE_AT, save_top_k=-1)
    run_scenario(
        replace(tiny("32-true"), steps=STEPS),
        accelerator="cpu",
        callbacks=[Window("activation"), monitor, save],
        validate=False,
        trainer_args={"enable_checkpointing": True, "default_root_dir": str(tmp)},
        ckpt_path=ckpt,
    )
    return monitor.findings


def test_resumed_run_reports_the_same_findings(tmp_path: Path) -> None:
    whole = run(tmp_path / "a", StabilityMonitor(Protect(stop_after=None), jsonl=False))
    assert any(f.severity.name == "CRITICAL" for f in whole)  # the episode crossed step 8
    ckpt = tmp_path / "a" / f"epoch=0-step={SAVE_AT}.ckpt"
    assert ckpt.exists()
    first = StabilityMonitor(Protect(stop_after=None), jsonl=False)
    state = torch.load(ckpt, weights_only=False)["callbacks"][first.state_key]
    assert state["bad_in_a_row"] == 2  # steps 6 and 7 were bad when the checkpoint was saved
    resumed = run(tmp_path / "b", first, ckpt)
    assert resumed == whole
    assert first.skipped_steps == 6


def test_two_monitors_coexist_in_a_checkpoint() -> None:
    assert StabilityMonitor().state_key != StabilityMonitor(policy="observe").state_key
