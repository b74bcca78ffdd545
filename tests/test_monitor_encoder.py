"""The monitor on a second, independently built GPT: ``nn.TransformerEncoderLayer`` + causal mask.

Parameter names follow PyTorch's (``encoder.layers.N.``), the attention is PyTorch's fused
``MultiheadAttention``: nothing of the reference model's layout is assumed.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from encoder_gpt import LitEncoderGPT
from stabilizer.callbacks.demo.run import run_scenario
from stabilizer.callbacks.monitor import StabilityMonitor
from stabilizer.core.records import Finding, Severity
from stabilizer.demo.scenarios import get_scenario


@pytest.fixture(autouse=True)
def _flush_denormals() -> Iterator[None]:
    # Post-LN starves input-side gradients down to ~1e-14; products of those land in float32
    # denormals, which x86 CPUs compute ~100x slower. GPUs flush them; so do we, for speed.
    torch.set_flush_denormal(True)
    yield
    torch.set_flush_denormal(False)


def _run(name: str, steps: int | None = None) -> list[Finding]:
    sc = get_scenario(name)
    monitor = StabilityMonitor(jsonl=False, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_scenario(
            replace(sc, steps=steps or sc.steps),
            accelerator="cpu",
            callbacks=[monitor],
            validate=False,
            module_class=LitEncoderGPT,
        )
    return monitor.findings


def test_spike_on_encoder_gpt() -> None:
    found = _run("spike", steps=200)
    start, stop = get_scenario("spike").corrupt or (0, 0)
    spikes = [f for f in found if f.kind == "loss_spike"]
    assert len(spikes) == 1 and start <= spikes[0].step < stop, [f.to_dict() for f in found]
    assert spikes[0].evidence["recovered"] == 1.0
    early = [f for f in found if f.severity >= Severity.WARNING and f.step < start]
    assert early == [], "nothing before the corrupted batches"


@pytest.mark.parametrize(
    ("name", "starved"),
    [("post-ln-deep", True), ("pre-ln-deep", False)],
    ids=["post-ln", "pre-ln"],
)
def test_depth_imbalance_on_encoder_gpt(name: str, starved: bool) -> None:
    found = [f for f in _run(name, steps=150) if f.kind == "depth_imbalance"]
    assert bool(found) == starved, [f.to_dict() for f in found]
    if starved:
        assert "block_00" in found[0].location and "input" in found[0].message
