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
