"""Literal and seeded float streams shared by the detector tests."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable

from stabilizer.detectors import Detector
from stabilizer.records import Finding, StepRecord

__all__ = ["eventful", "falling_loss", "feed", "healthy", "noisy", "records"]


def records(key: str, values: Iterable[float], start: int = 0) -> list[StepRecord]:
    """One record per value, ``{key: value}``, at steps start, start + 1, ..."""
    return [StepRecord(start + i, {key: v}) for i, v in enumerate(values)]


def noisy(values: Iterable[float], rel: float, seed: int = 0) -> list[float]:
    """Each value times (1 + N(0, rel)): minibatch noise of relative size ``rel``."""
    rng = random.Random(seed)
    return [v * (1.0 + rng.gauss(0.0, rel)) for v in values]


def falling_loss(n: int, start: float = 10.8, end: float = 2.5, tau: float = 150.0) -> list[float]:
    """A loss curve falling exponentially from ``start`` (ln 50k vocabulary) towards ``end``."""
    return [end + (start - end) * math.exp(-i / tau) for i in range(n)]


def feed(detector: Detector, stream: Iterable[StepRecord]) -> list[Finding]:
    """Every finding of a whole stream, `finish` included."""
    found: list[Finding] = []
    for record in stream:
        found += detector.update(record)
    return found + detector.finish()


def eventful(n: int = 700, seed: int = 0) -> list[StepRecord]:
    """A stream on which every built-in detector fires: spikes, NaNs, an fp16 cascade, clipping,
    growing activations and a starved band of blocks, with missing keys here and there."""
    rng = random.Random(seed)
    scale = 65536.0
    stream = []
    for step in range(n):
        loss = 2.5 * (1 + rng.gauss(0, 0.05)) + (5.0 if 200 <= step < 204 else 0.0)
        loss = math.nan if step in (300, 450, 451, 452, 453, 454, 455) else loss
        norm = math.exp(rng.gauss(0, 0.2)) * (40.0 if step in (250, 251) else 1.0)
        skipped = step < 4 or 500 <= step < 510
        scale = scale / 2 if skipped else scale
        values = {"loss": loss, "grad_norm": norm, "loss_scale": scale, "skipped": float(skipped)}
        values["clipped"] = float(350 <= step < 600)
        for i in range(8):
            level = 1e-5 if i < 3 and step >= 100 else 1.0
            values[f"grad_norm/block_{i:02d}"] = level * math.exp(rng.gauss(0, 0.3))
        if step % 10 == 0:
            values["act_absmax/blocks.1.mlp"] = 100.0 * 2.0 ** max(0, step // 10 - 50)
        if step % 7 == 3:
            del values["loss"], values["loss_scale"]
        stream.append(StepRecord(step, values))
    return stream


def healthy(n: int = 2000, seed: int = 0) -> list[StepRecord]:
    """A healthy fp16 run with every signal: a noisy falling loss, log-normal gradient norms, a
    pre-LN depth profile, occasional clipping, a probing loss scaler, sampled activations."""
    rng = random.Random(seed)
    losses = noisy(falling_loss(n), 0.08, seed)
    scale = 65536.0
    stream = []
    for step in range(n):
        skipped = step < 4 or step % 1000 == 1  # start-up calibration, then probing
        scale = scale / 2 if skipped else scale * 2 if step % 1000 == 0 and step else scale
        values = {"loss": losses[step], "loss_scale": scale, "skipped": float(skipped)}
        values["grad_norm"] = (0.5 + 2 * math.exp(-step / 200)) * math.exp(rng.gauss(0, 0.2))
        values["clipped"] = float(rng.random() < 0.1)
        values["lr"] = 3e-4 * min(1.0, (step + 1) / 100)
        values["nonfinite_grads"] = 0.0
        for i in range(12):
            noise = math.exp(rng.gauss(0, 0.3))
            values[f"grad_norm/block_{i:02d}"] = 10 ** (1 - i / 11) * noise
            values[f"update_ratio/block_{i:02d}"] = 1e-3 * noise
        if step % 50 == 0:
            for module in ("blocks.0.mlp", "blocks.5.attn", "lm_head"):
                values[f"act_absmax/{module}"] = rng.uniform(20.0, 900.0)
        stream.append(StepRecord(step, values))
    return stream
