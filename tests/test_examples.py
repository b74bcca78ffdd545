"""Examples run as scripts, as a user runs them."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_train_scenario_example_runs(tmp_path: Path) -> None:
    cmd = [sys.executable, "examples/train_scenario.py", "--steps", "5", "--accelerator", "cpu"]
    cmd += ["--log-dir", str(tmp_path)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "healthy: final metrics" in out.stdout
    assert "stabilizer: on, policy protect" in out.stderr  # #33: the monitor watches it
    assert "stabilizer: done at step 5" in out.stderr
    # (#41) under the scenario's name, as the demo's: runs/healthy/..., not runs/stability_logs
    assert list((tmp_path / "healthy").rglob("stability.jsonl"))


def _run(*cmd: str, **env: str) -> subprocess.CompletedProcess[str]:
    bin_dir = str(Path(sys.executable).parent)
    full = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), **env}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=full)


def _records(log_dir: Path) -> list[dict[str, object]]:
    """The records of the one ``stability.jsonl`` under ``log_dir``."""
    (path,) = log_dir.rglob("stability.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def _losses(records: list[dict[str, object]]) -> dict[int, float]:
    return {
        r["step"]: float(r["values"]["loss"])  # type: ignore[index,misc]
        for r in records
        if r["type"] == "step"
    }


def test_own_module_example_and_the_ci_gate(tmp_path: Path) -> None:
    """The monitor on a user's module catches its NaN; the CI gate fails on that log (1) and
    passes a clean one (0)."""
    bad, good = tmp_path / "bad", tmp_path / "good"
    out = _run(sys.executable, "examples/own_module.py", "--steps", "8", "--nan-at", "4",
               "--log-dir", str(bad))  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "stabilizer: on, policy protect; 6 depth groups: embed, block_00…block_03, head" in (
        out.stderr
    )
    assert "loss is nan at step 4; step skipped, weights intact" in out.stderr
    assert "StabilityMonitor: preflight" not in out.stderr
    gate = _run("sh", "examples/ci_gate.sh", str(bad))
    assert gate.returncode == 1, gate.stdout[-2000:] + gate.stderr[-2000:]
    assert "non-finite loss" in gate.stdout
    out = _run(sys.executable, "examples/own_module.py", "--steps", "4", "--log-dir", str(good))
    assert out.returncode == 0, out.stderr[-2000:]
    assert _run("sh", "examples/ci_gate.sh", str(good)).returncode == 0


def test_hf_gpt2_example(tmp_path: Path) -> None:
    """GPT-2's parameter names fall into the right groups, its causal mask passes the preflight,
    a NaN in block 1's MLP is skipped and named, and `diagnose` explains it afterwards."""
    if not os.environ.get("CI"):  # CI installs the hf extra: there a missing transformers fails
        pytest.importorskip("transformers")
    out = _run(sys.executable, "examples/hf_gpt2.py", "--steps", "6", "--nan-at", "3",
               "--log-dir", str(tmp_path))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    start = "stabilizer: on, policy protect; 6 depth groups: embed, block_00…block_03, head; log:"
    assert start in out.stderr  # nothing in `other`: wte/wpe, h.N, ln_f (lm_head is wte) placed
    assert "StabilityMonitor: preflight" not in out.stderr and "causal_leak" not in out.stderr
    assert "loss is nan at step 3; step skipped, weights intact" in out.stderr
    assert "root_cause [transformer.h.1.mlp]" in out.stderr
    records = _records(tmp_path)
    assert not [r for r in records if r["type"] == "finding" and r["step"] != 3]
    losses = _losses(records)
    assert sorted(losses) == [0, 1, 2, 3, 4, 5] and math.isnan(losses[3])
    assert all(math.isfinite(losses[s]) for s in (4, 5))  # the weights were kept finite
    report = _run("stabilizer", "diagnose", str(tmp_path))
    assert report.returncode == 1, report.stdout[-2000:] + report.stderr[-2000:]
    assert "#1  step 3  ERROR  non-finite loss (NaN/Inf)" in report.stdout
    assert "transformer.h.1.mlp produced NaN/Inf in the forward pass" in report.stdout


def test_ddp_a_failing_jsonl_on_rank_0_hangs_nobody(tmp_path: Path) -> None:
    """Rank 0's JSONL writes fail (``/dev/full``: no space left), the NaN is on rank 1 in an
    accumulated step: every rank still joins the root cause's collective, the console goes on,
    the replicas stay identical, and the cause is rank 1's first micro-batch."""
    out = _run(sys.executable, "examples/ddp.py", "--steps", "8", "--nan-at", "4",
               "--accumulate", "2", "--jsonl", "/dev/full", "--log-dir", str(tmp_path),
               OMP_NUM_THREADS="1")  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = re.findall(r"^rank (\d): step (\d+), (\d+) skipped, weights (\w+)$", out.stdout, re.M)
    assert sorted(r[:3] for r in ranks) == [("0", "8", "1"), ("1", "8", "1")], out.stdout
    assert ranks[0][3] == ranks[1][3]
    assert "the jsonl output stopped after an error" in out.stderr
    assert "root_cause [blocks.1]: rank 1: micro-batch 1 of 2: " in out.stderr
    assert "stabilizer: done at step 8" in out.stderr  # the console outlived the JSONL


def test_ddp_example_nan_on_one_rank_skips_everywhere(tmp_path: Path) -> None:
    """``protect`` under ``Trainer(strategy="ddp")``, 2 CPU ranks over gloo: a NaN on rank 1
    skips the step on both, the replicas stay identical, rank 0 alone reports."""
    out = _run(sys.executable, "examples/ddp.py", "--steps", "10", "--nan-at", "4",
               "--log-dir", str(tmp_path), OMP_NUM_THREADS="1")  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = re.findall(r"^rank (\d): step (\d+), (\d+) skipped, weights (\w+)$", out.stdout, re.M)
    # Nobody hung: both trained to the end, skipped the same step, and did not drift apart.
    assert sorted(r[:3] for r in ranks) == [("0", "10", "1"), ("1", "10", "1")], out.stdout
    assert ranks[0][3] == ranks[1][3]
    # The console: rank 0 only, one line per finding; the root cause is rank 1's answer.
    assert out.stderr.count("stabilizer: step 4 error nonfinite_loss") == 1
    assert out.stderr.count("stabilizer: step 4 error root_cause [blocks.1]: rank 1: ") == 1
    # One JSONL (rank 0's), each finding once; the steps after the NaN train on finite weights.
    records = _records(tmp_path)
    found = sorted(str(r["kind"]) for r in records if r["type"] == "finding")
    assert found == ["nonfinite_loss", "root_cause"]
    losses = _losses(records)
    assert math.isnan(losses[4]) and all(math.isfinite(losses[s]) for s in range(5, 10))


def test_plain_loop_example(tmp_path: Path) -> None:
    """nanoGPT's loop with the Stabilizer: a NaN in block 1's MLP in an accumulated step is
    skipped and named, as the Lightning callback says it; `diagnose` reads the log after."""
    out = _run(sys.executable, "examples/plain_loop.py", "--steps", "8", "--nan-at", "4",
               "--log-dir", str(tmp_path), OMP_NUM_THREADS="1")  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    start = "stabilizer: on, policy protect; 4 depth groups: embed, block_00…block_01, head; log:"
    assert start in out.stderr
    assert "loss is nan at step 4; step skipped, weights intact" in out.stderr
    assert "root_cause [blocks.1.mlp]: micro-batch 1 of 2: blocks.1.mlp produced" in out.stderr
    assert "stabilizer: done at step 8: 2 findings (2 error)" in out.stderr
    losses = _losses(_records(tmp_path))
    assert sorted(losses) == list(range(8)) and math.isnan(losses[4])
    assert all(math.isfinite(losses[s]) for s in range(5, 8))
    report = _run("stabilizer", "diagnose", str(tmp_path))
    assert report.returncode == 1, report.stdout[-2000:] + report.stderr[-2000:]
    assert "blocks.1.mlp produced NaN/Inf in the forward pass" in report.stdout


def test_plain_loop_under_torchrun_skips_on_every_rank(tmp_path: Path) -> None:
    """The plain loop under DDP (torchrun, 2 CPU processes, gloo), a NaN in rank 1's first
    micro-batch: both ranks skip that step and end bit-identical; rank 0 alone reports, and
    the root cause is rank 1's."""
    out = _run(sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "examples/plain_loop.py", "--steps", "8",
               "--nan-at", "4", "--nan-rank", "1", "--log-dir", str(tmp_path),
               OMP_NUM_THREADS="1")  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = re.findall(r"^rank (\d): step (\d+), (\d+) skipped, weights (\w+)$", out.stdout, re.M)
    assert sorted(r[:3] for r in ranks) == [("0", "8", "1"), ("1", "8", "1")], out.stdout
    assert ranks[0][3] == ranks[1][3]
    assert out.stderr.count("stabilizer: step 4 error nonfinite_loss") == 1
    assert "root_cause [blocks.1.mlp]: rank 1: micro-batch 1 of 2: " in out.stderr
    found = sorted(str(r["kind"]) for r in _records(tmp_path) if r["type"] == "finding")
    assert found == ["nonfinite_loss", "root_cause"]


def test_fabric_example(tmp_path: Path) -> None:
    out = _run(sys.executable, "examples/fabric.py", "--steps", "6", "--nan-at", "3",
               "--log-dir", str(tmp_path), OMP_NUM_THREADS="1")  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "loss is nan at step 3; step skipped, weights intact" in out.stderr
    assert "root_cause [blocks.1.mlp]: micro-batch 1 of 2: blocks.1.mlp produced" in out.stderr
    run = next(r for r in _records(tmp_path) if r["type"] == "run")
    assert run["strategy"] == "SingleDeviceStrategy" and run["precision"] == "32-true"
    losses = _losses(_records(tmp_path))
    assert sorted(losses) == list(range(6)) and math.isnan(losses[3])


def test_hf_trainer_example(tmp_path: Path) -> None:
    """`StabilityCallback` in HF's Trainer: the NaN step is skipped under gradient accumulation
    and named; the monitor's pre-clip norm is the one HF logs."""
    if not os.environ.get("CI"):  # CI installs the hf extra: there a missing transformers fails
        pytest.importorskip("transformers")
    out = _run(sys.executable, "examples/hf_trainer.py", "--steps", "10", "--nan-at", "5",
               "--log-dir", str(tmp_path), OMP_NUM_THREADS="1")  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    start = "stabilizer: on, policy protect; 6 depth groups: embed, block_00…block_03, head; log:"
    assert start in out.stderr
    assert "loss is nan at step 5; step skipped, weights intact" in out.stderr
    assert "root_cause [transformer.h.1.mlp]: micro-batch 1 of 2: " in out.stderr
    records = _records(tmp_path)
    losses = _losses(records)
    assert sorted(losses) == list(range(10)) and math.isnan(losses[5])
    logged = [json.loads(line.replace("'", '"')) for line in out.stdout.splitlines()
              if line.startswith("{'loss'")]  # fmt: skip
    step9 = next(r["values"] for r in records if r["type"] == "step" and r["step"] == 9)
    assert float(logged[0]["grad_norm"]) == pytest.approx(step9["grad_norm"], abs=1e-3)
