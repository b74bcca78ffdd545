"""The engine and the detectors give, on many streams, the findings recorded in a golden file.

`golden_findings.jsonl` holds the findings of straightforward, unoptimised code (the detectors as
they were before the engine was made fast: a sorted copy of the window for every median, the
engine testing every detector's signals on every record, ...) on the conformance streams, on
healthy runs and on seeded chaotic streams, each through the default detectors and through two
sets of detectors with unusual arguments (tiny and even windows, no floors, patience 1).
Any change to what a detector reports shows up here; regenerate the file only for an intended
change of behaviour, and review its diff:

    cd tests && ../.venv/bin/python -m detectors.test_equivalence
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stabilizer.core.detectors import (
    DepthImbalance,
    Detector,
    Fp16Overflow,
    GradSpike,
    LossSpike,
    NonFinite,
    OverflowRisk,
    default_detectors,
)
from stabilizer.core.engine import Engine
from stabilizer.core.records import Finding, StepRecord

from .streams import chaotic, eventful, healthy

GOLDEN = Path(__file__).with_name("golden_findings.jsonl")  # [config, stream, finding] a line


def _odd_arguments() -> list[Detector]:
    return [
        NonFinite(persistent_after=2),
        LossSpike(window=8, min_history=8, k=2.0, rel_floor=0.0, recover_k=0.0, settle_steps=5),
        GradSpike(window=7, min_history=2, k=3.0, sigma_floor=0.0, min_ratio=2.0, recover_k=0.0),
        Fp16Overflow(cascade=2, drop_pow=2, window=10, floor=4.0, quiet=5),
        OverflowRisk(fraction=0.2, growth=1.5, samples=2, min_level=100.0),
        DepthImbalance(ratio=8.0, patience=1, alpha=1.0, min_blocks=4),
    ]


def _wide_arguments() -> list[Detector]:
    return [
        LossSpike(window=51, min_history=2, k=3.0, rel_floor=0.01, settle_steps=30),
        GradSpike(window=64, min_history=64, k=2.0, clip_window=10, clip_fraction=0.2),
        Fp16Overflow(window=2, cascade=40, drop_pow=1, floor=0.0, quiet=1),
        DepthImbalance(ratio=1e6, patience=3, alpha=0.5, min_blocks=12),
    ]


CONFIGS: dict[str, Callable[[], list[Detector]]] = {
    "defaults": default_detectors,
    "odd": _odd_arguments,
    "wide": _wide_arguments,
}
STREAMS: dict[str, Callable[[], list[StepRecord]]] = {
    **{f"eventful-{seed}": lambda seed=seed: eventful(700, seed) for seed in range(4)},
    **{f"healthy-{seed}": lambda seed=seed: healthy(2000, seed) for seed in range(2)},
    **{f"chaotic-{seed}": lambda seed=seed: chaotic(2000, seed) for seed in range(6)},
}


def findings(config: str, stream: str) -> list[dict[str, Any]]:
    """The findings of one configuration on one stream, as `Finding.to_dict` dicts."""
    return [f.to_dict() for f in Engine(CONFIGS[config]()).replay(STREAMS[stream]())]


def _same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    """Equal dicts; evidence floats equal to 1e-12 (libm may differ in the last bit elsewhere)."""
    if {k: v for k, v in got.items() if k != "evidence"} != {
        k: v for k, v in want.items() if k != "evidence"
    }:
        return False
    a, b = got["evidence"], want["evidence"]
    return a.keys() == b.keys() and all(
        a[k] == b[k] or (isinstance(a[k], float) and math.isclose(a[k], b[k], rel_tol=1e-12))
        for k in a
    )


@pytest.fixture(scope="module")
def golden() -> dict[str, dict[str, list[dict[str, Any]]]]:
    data: dict[str, dict[str, list[dict[str, Any]]]] = {
        c: {s: [] for s in STREAMS} for c in CONFIGS
    }
    for line in GOLDEN.read_text().splitlines():
        config, stream, finding = json.loads(line)
        data[config][stream].append(finding)
    return data


@pytest.mark.parametrize("stream", list(STREAMS))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_findings_match_the_golden_file(config: str, stream: str, golden: Any) -> None:
    got, want = findings(config, stream), golden[config][stream]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert _same(g, w), (g, w)


def test_golden_streams_cover_every_kind(golden: Any) -> None:
    kinds = {f["kind"] for streams in golden.values() for found in streams.values() for f in found}
    assert kinds >= {
        "loss_spike",
        "divergence",
        "nonfinite_loss",
        "nonfinite_grad",
        "grad_spike",
        "clip_saturation",
        "fp16_overflow",
        "overflow_risk",
        "depth_imbalance",
    }
    assert all(Finding.from_dict(f) for found in golden["defaults"].values() for f in found)


if __name__ == "__main__":
    with GOLDEN.open("w") as out:
        for config in CONFIGS:
            for stream in STREAMS:
                for finding in findings(config, stream):
                    row = [config, stream, finding]
                    out.write(json.dumps(row, separators=(",", ":"), sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
