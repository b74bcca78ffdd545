"""Literal and seeded float streams shared by the detector tests."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable

from stabilizer.core.detectors import Detector
from stabilizer.core.records import Finding, StepRecord

__all__ = ["chaotic", "eventful", "falling_loss", "feed", "healthy", "noisy", "records"]


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


_EVENTS = {  # kind -> (chance to start on a step, shortest, longest duration)
    "loss_spike": (0.004, 1, 12),
    "loss_shift": (0.0008, 120, 400),
    "nan": (0.002, 1, 8),
    "grad_spike": (0.004, 1, 6),
    "clip": (0.002, 50, 300),
    "cascade": (0.002, 2, 40),
    "starve_input": (0.001, 30, 300),
    "starve_output": (0.001, 30, 300),
    "act_growth": (0.003, 10, 60),
    "flat": (0.002, 30, 200),
    "sparse": (0.003, 1, 30),
}


def _events(rng: random.Random, step: int, until: dict[str, int]) -> set[str]:
    """Start events at random; return the kinds active at ``step``."""
    for kind, (chance, low, high) in _EVENTS.items():
        if until.get(kind, -1) < step and rng.random() < chance:
            until[kind] = step + rng.randint(low, high) - 1
    return {kind for kind, last in until.items() if last >= step}


def _odd(rng: random.Random, value: float) -> float:
    """``value``, now and then replaced by 0, -0, a negative, NaN or +-Inf."""
    if rng.random() < 0.995:
        return value
    return rng.choice([0.0, -0.0, -value, math.nan, math.inf, -math.inf])


def _loss(rng: random.Random, step: int, on: set[str], spec: dict[str, float]) -> float:
    noise = 0.0 if "flat" in on else rng.gauss(0, spec["noise"])
    loss = spec["level"] * (1 + math.exp(-step / 300)) * (1 + noise)
    loss += spec["height"] if "loss_spike" in on else 0.0
    loss *= spec["shift"] if "loss_shift" in on else 1.0
    return rng.choice([math.nan, math.inf]) if "nan" in on else _odd(rng, loss)


def _scaler(rng: random.Random, step: int, on: set[str], spec: dict[str, float]) -> bool:
    """Advance the fp16 loss scale (``spec["scale"]``); whether the step was skipped."""
    start_up = step < spec["start_up"]
    probe = step % int(spec["interval"]) == 1
    skipped = start_up or probe or ("cascade" in on and step % int(spec["gap"]) == 0)
    if skipped:
        spec["scale"] = max(spec["scale"] / 2, 2.0**-4)
    elif step % int(spec["interval"]) == 0:
        spec["scale"] = min(spec["scale"] * 2, 2.0**24)
    return skipped


def _blocks(rng: random.Random, on: set[str], spec: dict[str, float]) -> dict[str, float]:
    n, band, values = int(spec["blocks"]), int(spec["band"]), {}
    for i in range(n):
        starved = ("starve_input" in on and i < band) or ("starve_output" in on and i >= n - band)
        level = 10 ** (1 - i / n) * (1e-5 if starved else 1.0) * math.exp(rng.gauss(0, 0.3))
        values[f"grad_norm/block_{i:02d}"] = _odd(rng, level)
        if spec["ratios"]:
            values[f"update_ratio/block_{i:02d}"] = _odd(rng, 1e-3 * level)
    if spec["ends"]:
        values["grad_norm/embed"], values["grad_norm/head"] = 0.5, 2.0
    return values


def _spec(rng: random.Random) -> dict[str, float]:
    return {
        "level": rng.choice([0.0, 1e-3, 0.3, 2.5, 10.8, 1e5]),
        "noise": rng.choice([0.0, 0.01, 0.05, 0.2]),
        "height": rng.choice([0.01, 0.5, 3.0, 50.0]),
        "shift": rng.choice([1.3, 3.0, 10.0]),
        "norm": rng.choice([-3.0, 0.0, 1.0]),
        "flag": rng.random() < 0.7,
        "clipped": rng.choice([0, 1, 2]),  # clipped logged, clip_val logged, neither
        "scale": 65536.0,
        "start_up": rng.choice([0, 3, 8]),
        "interval": rng.choice([40, 150, 1000]),
        "gap": rng.choice([1, 1, 3, 12]),
        "blocks": rng.choice([4, 5, 12, 24]),
        "band": rng.choice([1, 2, 3]),
        "ratios": rng.random() < 0.5,
        "ends": rng.random() < 0.5,
        "shuffle": rng.random() < 0.2,
    }


def _values(
    rng: random.Random, step: int, on: set[str], spec: dict[str, float]
) -> dict[str, float]:
    values = {"loss": _loss(rng, step, on, spec), "lr": 3e-4}
    jump = 10 ** rng.uniform(1, 3) if "grad_spike" in on else 1.0
    norm = 10 ** (spec["norm"] + rng.gauss(0, 0.15)) * jump
    values["grad_norm"] = math.nan if "nan" in on and rng.random() < 0.5 else _odd(rng, norm)
    if spec["clipped"] == 0:
        values["clipped"] = float(rng.random() < (0.9 if "clip" in on else 0.1))
    elif spec["clipped"] == 1:
        values["clip_val"] = 10 ** spec["norm"] * (0.5 if "clip" in on else 3.0)
    skipped = _scaler(rng, step, on, spec)
    values["loss_scale"] = spec["scale"]
    if spec["flag"]:
        values["skipped"] = float(skipped)
    values["nonfinite_grads"] = float("nan" in on and rng.random() < 0.7)
    values.update(_blocks(rng, on, spec))
    if step % 25 == 0 or "act_growth" in on:
        grow = 2.0 ** (step % 40) if "act_growth" in on else 1.0
        values["act_absmax/blocks.0.mlp"] = _odd(rng, rng.uniform(10.0, 900.0) * grow)
        values["act_absmax/lm_head"] = _odd(rng, rng.uniform(10.0, 900.0))
    return values


def chaotic(n: int = 3000, seed: int = 0) -> list[StepRecord]:
    """A seeded stream of everything going wrong at random, over a randomly chosen setup: loss
    spikes and shifts, NaN bursts, gradient spikes, clipping bursts, fp16 cascades (consecutive or
    spread), starved bands at either end, growing activations, flat losses, odd values (0, -0,
    negatives, NaN, Inf), records missing most of their keys, and now and then shuffled keys."""
    rng = random.Random(seed)
    spec, until, stream = _spec(rng), {}, []
    for step in range(n):
        on = _events(rng, step, until)
        values = _values(rng, step, on, spec)
        if "sparse" in on:
            values = {k: v for k, v in values.items() if rng.random() < 0.3}
        if spec["shuffle"] and rng.random() < 0.5:
            items = list(values.items())
            rng.shuffle(items)
            values = dict(items)
        stream.append(StepRecord(step, values))
    return stream
