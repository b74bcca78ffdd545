"""Loss-spike rules compared on real runs: ours, Lightning's and OLMo-core's.

    python benchmarks/detection_quality.py [--seeds 5]

Trains the ``healthy`` scenario (several seeds: noisy, steeply falling early losses), ``spike``
(corrupted batches at 150-154) and ``diverge`` (LR surge at 150) with the real ``StabilityMonitor``,
then runs three rules over the same loss streams:

- ours: ``LossSpike`` defaults (median/MAD of 50 steps, k=6, a 1.5x / +0.5 nat jump), as the
  engine runs it live;
- Lightning ``SpikeDetection`` defaults: loss >= 3x the running mean of the last 10 losses;
- OLMo-core: loss > mean + 6 sigma of the last 128 losses.

The spike runs are also scored with their spike window scaled to 30% of its height above the
baseline (a moderate, ~1.6x spike on the same real curve).

A rule's flagged steps are merged into episodes (consecutive steps = one episode). The table shows,
per rule, the false episodes on the healthy runs, and whether and where each injected failure was
caught. Results are recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from stabilizer.callbacks import StabilityMonitor
from stabilizer.callbacks.demo.run import run_scenario
from stabilizer.core.detectors.loss_spike import LossSpike
from stabilizer.core.records import StepRecord
from stabilizer.demo.scenarios import get_scenario

Rule = Callable[[Sequence[float]], list[int]]


def lightning_rule(losses: Sequence[float], window: int = 10, rtol: float = 2.0) -> list[int]:
    """Lightning ``SpikeDetection`` (mode min): loss - mean >= rtol * mean, mean of last 10."""
    flagged: list[int] = []
    seen: list[float] = []
    for i, x in enumerate(losses):
        if i >= 1 and seen:
            mean = statistics.fmean(seen[-window:])
            if x - mean >= rtol * mean:
                flagged.append(i)
        seen.append(x)  # Lightning updates the running mean with every value, spikes included
    return flagged


def olmo_rule(losses: Sequence[float], window: int = 128, sigmas: float = 6.0) -> list[int]:
    """OLMo-core: loss > mean + 6 sigma over the last 128 losses (after 128 steps of history)."""
    flagged = []
    for i in range(window, len(losses)):
        hist = losses[i - window : i]
        if losses[i] > statistics.fmean(hist) + sigmas * statistics.pstdev(hist):
            flagged.append(i)
    return flagged


def our_rule(losses: Sequence[float]) -> list[int]:
    """``LossSpike`` with defaults: the start step of each finding (spike or divergence)."""
    detector = LossSpike()
    found = [f for i, x in enumerate(losses) for f in detector.update(StepRecord(i, {"loss": x}))]
    found += detector.finish()
    return [f.step for f in found]


def episodes(steps: list[int]) -> list[int]:
    """Start steps of runs of consecutive flagged steps."""
    return [s for i, s in enumerate(steps) if i == 0 or steps[i - 1] != s - 1]


def losses_of(name: str, seed: int, root: Path) -> list[float]:
    """The loss stream of a real run, as the monitor logged it to ``stability.jsonl``."""
    sc = replace(get_scenario(name), seed=seed)
    path = root / f"{name}-{seed}.jsonl"
    run_scenario(sc, accelerator="cpu", callbacks=[StabilityMonitor(jsonl=path)])
    items = map(json.loads, path.read_text().splitlines())
    return [StepRecord.from_dict(d).values["loss"] for d in items if d["type"] == "step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("stabilizer").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    rules: dict[str, Rule] = {"ours": our_rule, "lightning": lightning_rule, "olmo": olmo_rule}
    with tempfile.TemporaryDirectory() as tmp:
        healthy = [losses_of("healthy", s, Path(tmp)) for s in range(args.seeds)]
        spike = [losses_of("spike", s, Path(tmp)) for s in range(min(args.seeds, 3))]
        diverge = losses_of("diverge", 0, Path(tmp))
    start, stop = get_scenario("spike").corrupt or (0, 0)
    moderate = [attenuate(x, start, stop, 0.3) for x in spike]
    print(
        f"{'rule':>10} {'false episodes (healthy)':>25} {'spike caught at':>22} "
        f"{'moderate spike caught at':>25} {'diverge':>14}"
    )
    for name, rule in rules.items():
        false = sum(len(episodes(rule(x))) for x in healthy)
        caught, weak = (
            " / ".join(",".join(str(s) for s in episodes(rule(x))) or "-" for x in runs)
            for runs in (spike, moderate)
        )
        div = ",".join(str(s) for s in episodes(rule(diverge))) or "-"
        print(f"{name:>10} {false:>25} {caught:>22} {weak:>25} {div:>14}")


def attenuate(losses: list[float], start: int, stop: int, factor: float) -> list[float]:
    """The run with its spike window scaled to ``factor`` of its height above the baseline
    (median of the 20 steps before): a moderate spike on the same real curve."""
    base = statistics.median(losses[start - 20 : start])
    return [
        base + factor * (x - base) if start <= i < stop + 10 and x > base else x
        for i, x in enumerate(losses)
    ]


if __name__ == "__main__":
    main()
