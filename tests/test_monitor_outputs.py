"""What the monitor writes: activation maxima at sampled steps only, every param group's LR, a
JSONL file of its own for each run without a logger (a resumed run appends to its own)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from test_protect import tiny

from stabilizer.callbacks.demo.run import run_scenario
from stabilizer.callbacks.monitor import StabilityMonitor


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Tiny models: one torch thread."""


def steps(path: Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [line for line in lines if line["type"] == "step"]


def train(
    root: Path,
    steps: int,
    monitor: StabilityMonitor,
    ckpt: Path | None = None,
    name: str = "a",
    stop_at: int | None = None,
) -> None:
    save = ModelCheckpoint(dirpath=root / name, every_n_train_steps=4, save_top_k=-1)
    args = {"enable_checkpointing": True, "default_root_dir": str(root)}
    run_scenario(
        replace(tiny("32-true"), steps=steps), accelerator="cpu", callbacks=[monitor, save],
        validate=False, ckpt_path=ckpt, trainer_args={**args, "max_steps": stop_at or steps},
    )  # fmt: skip


def test_activation_maxima_only_at_sampled_steps(tmp_path: Path) -> None:
    # Old code: the last sample was logged again at every step, as if measured there.
    path = tmp_path / "s.jsonl"
    train(tmp_path, 8, StabilityMonitor(activation_every=3, jsonl=path, preflight=False))
    records = steps(path)
    assert [r["step"] for r in records] == list(range(8))
    sampled = [r["step"] for r in records if any(k.startswith("act_absmax/") for k in r["values"])]
    assert sampled == [0, 3, 6]


def test_every_param_group_lr_is_logged(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    train(tmp_path, 4, StabilityMonitor(jsonl=path, preflight=False))
    values = steps(path)[-1]["values"]
    # LitGPT: weights with decay, biases and gains without; the same schedule.
    assert values["lr/pg2"] == values["lr"] > 0
    assert "lr/pg3" not in values


def test_without_a_logger_each_run_has_its_own_jsonl(tmp_path: Path) -> None:
    # Old code: every run appended to one stability.jsonl, which then read as one restarted run.
    train(tmp_path, 8, StabilityMonitor(preflight=False), stop_at=4)  # interrupted at step 4
    train(tmp_path, 8, StabilityMonitor(preflight=False), name="b")
    first = tmp_path / "stability_logs" / "version_0" / "stability.jsonl"
    second = tmp_path / "stability_logs" / "version_1" / "stability.jsonl"
    assert [r["step"] for r in steps(first)] == list(range(4))
    assert [r["step"] for r in steps(second)] == list(range(8))
    # The first run, resumed from its checkpoint, continues in its own file.
    ckpt = tmp_path / "a" / "epoch=0-step=4.ckpt"
    train(tmp_path, 8, StabilityMonitor(preflight=False), ckpt)
    assert [r["step"] for r in steps(first)] == list(range(8))
    assert [r["step"] for r in steps(second)] == list(range(8))
    assert not (tmp_path / "stability_logs" / "version_2").exists()
