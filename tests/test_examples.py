"""Examples run as scripts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_train_scenario_example_runs() -> None:
    cmd = [sys.executable, "examples/train_scenario.py", "--steps", "5", "--accelerator", "cpu"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "healthy: final metrics" in out.stdout


def _run(*cmd: str, **env: str) -> subprocess.CompletedProcess[str]:
    import os

    bin_dir = str(Path(sys.executable).parent)
    full = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), **env}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=full)


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
    gate = _run("sh", "examples/ci_gate.sh", str(bad))
    assert gate.returncode == 1, gate.stdout[-2000:] + gate.stderr[-2000:]
    assert "non-finite loss" in gate.stdout
    out = _run(sys.executable, "examples/own_module.py", "--steps", "4", "--log-dir", str(good))
    assert out.returncode == 0, out.stderr[-2000:]
    assert _run("sh", "examples/ci_gate.sh", str(good)).returncode == 0
