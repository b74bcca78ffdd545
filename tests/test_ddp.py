"""``protect`` under ``Trainer(strategy="ddp")``: a NaN on one rank skips the step on all.

Two CPU ranks over gloo, launched from a subprocess (``ddp_protect.py``); ~10 s of start-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from test_protect import FAULT_STEPS, STEPS

SCRIPT = Path(__file__).with_name("ddp_protect.py")


def test_nan_on_one_rank_skips_everywhere(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SCRIPT.parent)}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:  # nobody hung, everyone trained to the end and skipped the same steps
        assert rank["step"] == STEPS and rank["skipped"] == len(FAULT_STEPS) and rank["finite"]
    assert ranks[0]["weights"] == ranks[1]["weights"]  # the replicas did not drift apart
    assert "nonfinite_loss" in ranks[0]["findings"]
    # Findings are logged once: one JSONL file (rank 0's), each finding once.
    lines = [json.loads(x) for x in (tmp_path / "stability.jsonl").read_text().splitlines()]
    found = {x["kind"]: x for x in lines if x["type"] == "finding" and x["step"] == FAULT_STEPS[0]}
    assert sorted(found) == ["nonfinite_loss", "root_cause"]
    # The console: rank 0 only, one line for the finding (the end summary names it again).
    step = FAULT_STEPS[0]
    assert done.stderr.count(f"stabilizer: step {step} error nonfinite_loss") == 1
    # Every rank replayed the step; the fault was on rank 1, and rank 1's answer is reported.
    cause = found["root_cause"]
    assert cause["location"] == ["blocks.1.mlp"] and cause["message"].startswith("rank 1: ")
