"""Row 1 of the article's table, end to end: in ``spike-sgd`` clipping is what rescues the run.

SGD with momentum and a zero-filled batch every 40 steps: without the monitor the run is thrown
off for good; ``auto`` clips the gradient norm to 1.0 after the first spike and ends within 10%
of the healthy twin (the 5-seed table is ``benchmarks/rescue.py``, docs/benchmarks.md).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import pytest
import torch

from stabilizer.callbacks.demo.run import ScenarioRun, run_scenario
from stabilizer.callbacks.monitor import StabilityMonitor
from stabilizer.demo.scenarios import Scenario, get_scenario

TOLERANCE = 1.10  # rescued: the validation loss within 10% of the twin's (as benchmarks/rescue.py)


def _val(sc: Scenario, monitor: StabilityMonitor | None = None) -> tuple[ScenarioRun, float]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = run_scenario(sc, accelerator="cpu", callbacks=[monitor] if monitor else [])
    val = float(run.trainer.callback_metrics.get("val/loss", math.nan))
    finite = all(bool(torch.isfinite(p).all()) for p in run.module.parameters())
    return run, val if finite and run.trainer.global_step == sc.steps else math.inf


@pytest.mark.slow
def test_auto_rescues_spike_sgd_by_clipping_and_doing_nothing_does_not() -> None:
    sc = replace(get_scenario("spike-sgd"), seed=0)
    _, twin = _val(sc.twin())
    _, none = _val(sc)
    monitor = StabilityMonitor(policy="auto", jsonl=False)
    run, auto = _val(sc, monitor)
    assert not none <= TOLERANCE * twin  # thrown off for good (NaN counts as inf)
    assert auto <= TOLERANCE * twin  # rescued
    applied = [f for f in monitor.findings if f.kind == "remedy_applied"]
    assert [(f.remedies[0], f.step) for f in applied] == [("clip_gradients", 41)]
    threshold = float(run.trainer.gradient_clip_val)  # 1.0, or 2x the run's healthy norm above 1
    assert threshold >= 1.0 and f"gradient clipping at norm {threshold:.3g}" in applied[0].message
    results = [f for f in monitor.findings if f.kind == "remedy_result"]
    assert [(f.remedies[0], f.evidence["worked"]) for f in results] == [("clip_gradients", 1.0)]
