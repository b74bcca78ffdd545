"""One ``stability.jsonl``, several runs (#41): each run its own facts and findings.

A script run twice with the same log dir (each example's default) appends a second run to the
first one's JSONL; a run resumed from a checkpoint taken before its NaN appends its steps
again. `diagnose` and `watch` used to move run 1's root cause into run 2, at a step where run 2
had no NaN, and call a new run "a restart". Real runs of the monitor: ``examples/plain_loop.py``
twice, and a plain loop resumed through `Stabilizer.state_dict`.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from test_watch import _Watcher

from stabilizer import Stabilizer
from stabilizer.cli import main
from stabilizer.demo.model import GPT, GPTConfig
from stabilizer.replay.diagnose import diagnose

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]


def _plain_loop(cwd: Path, *args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "plain_loop.py"), "--steps", "24", *args],
        cwd=cwd, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_script_run_twice_is_two_runs_in_diagnose_and_watch(
    tmp_path: Path, watcher: list[_Watcher]
) -> None:
    _plain_loop(tmp_path, "--nan-at", "12")  # run 1: a NaN made in blocks.1.mlp at step 12
    folder = tmp_path / "runs" / "plain_loop"
    w = _Watcher(str(folder))
    watcher.append(w)
    w.wait_for("following", "err")
    _plain_loop(tmp_path, "--nan-at", "18")  # run 2, into the same stability.jsonl
    w.wait_for("step 18 error nonfinite_loss")  # run 2's NaN, as it came
    diagnosis = diagnose(str(folder / "stability.jsonl"))
    found = {(item.segment, item.finding.kind, item.finding.step) for item in diagnosis.findings}
    assert {(1, "root_cause", 12), (2, "root_cause", 18)} <= found
    assert not {(2, "root_cause", 12), (2, "nonfinite_loss", 12)} & found  # run 1's, not 2's
    first, second = diagnosis.segments
    assert second.new_run and not first.new_run and second.run is not None
    text = CliRunner().invoke(main, ["diagnose", str(folder)]).output
    assert "segments  2 (2 runs in one log)" in text and "a new run: step went back" in text
    assert "restart" not in text
    assert w.interrupt() == 1
    watched = "\n".join(w.out)
    assert "2 runs in one log" in watched and "restart" not in watched, watched
    assert not any("step 12" in line for line in w.out[:1]), w.out[:2]  # history: not said


class _Fault:
    """Block 1's MLP outputs NaN at step ``at`` (a module that overflows, once)."""

    def __init__(self, model: GPT, at: int) -> None:
        self.step, self.at = -1, at
        model.get_submodule("blocks.1.mlp").register_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: object, out: torch.Tensor) -> Any:
        return out * float("nan") if module.training and self.step == self.at else None


def _train(
    log_dir: Path, steps: int, *, nan_at: int = -1, save_at: int = -1, state: Any = None
) -> Any:
    """A plain loop with the Stabilizer; resumed from ``state``; returns the state at
    ``save_at`` (model, optimizer and the Stabilizer's, as a loop's checkpoint holds them)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fault = _Fault(model, nan_at)
    stab = Stabilizer(model, optimizer, clip=1.0, log_dir=str(log_dir))
    first = 0
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        stab.load_state_dict(state["stab"])
        first = save_at + 1
    data = torch.randint(0, 256, (steps, 2, 17))
    saved = None
    for step in range(first, steps):
        fault.step = step
        with stab.step():
            _, loss = model(data[step][:, :-1], data[step][:, 1:])
            stab.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if step == save_at and state is None:
            saved = copy.deepcopy(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "stab": stab.state_dict()}
            )  # fmt: skip
    stab.close()
    return saved


def test_a_run_resumed_before_its_nan_keeps_the_nan_in_the_first_run(tmp_path: Path) -> None:
    state = _train(tmp_path, 24, nan_at=15, save_at=8)  # the NaN at 15, a checkpoint at 8
    _train(tmp_path, 24, save_at=8, state=state)  # resumed at 9: no NaN this time
    diagnosis = diagnose(str(tmp_path / "stability.jsonl"))
    found = {(item.segment, item.finding.kind, item.finding.step) for item in diagnosis.findings}
    assert (1, "root_cause", 15) in found
    assert not any(segment == 2 for segment, _, _ in found)  # before: run 1's root cause here
    second = diagnosis.segments[1]
    assert (second.first_step, second.new_run) == (9, False) and "restart" in second.why
    text = CliRunner().invoke(main, ["diagnose", str(tmp_path)]).output
    assert "segment 2, after the last restart, is clean" in text
    assert "the run was restarted" in text and "a new run" not in text
