"""Setups users write, tried as they write them: healthy as without the monitor, a NaN skipped.

A setup is a function ``run(ctx) -> front`` that trains a small model a few steps under one
host, the way a user writes that setup, with the monitor on when ``ctx.monitored`` (``front`` is
then its `Stabilizer`, `StabilityMonitor` or `StabilityCallback`, else None). It calls
``ctx.begin(step, modules, optimizers)`` before each micro-batch's forward (a host's own
callback does it under Lightning and the HF Trainer) and ``ctx.finish(...)`` at the end, and
makes its model NaN at ``ctx.nan_at`` through ``ctx.nan(...)`` (a forward hook's output) or the
batches of ``ctx.batches`` (a NaN input).

`check(run, tmp)` trains it three times — without the monitor, with it (policy ``protect``),
and with it and one NaN — and asserts what docs/protection.md promises: the healthy run ends
bit-identical to the run without the monitor, with no step skipped and no non-finite finding;
the NaN step is skipped, leaving parameters, optimizer state and buffers bit-identical, and
everything ends finite; the console's end line, the JSONL and the front end agree on what was
skipped, and "weights intact" is said only of skipped steps.
"""

from __future__ import annotations

import json
import logging
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

NAN = {"nonfinite_loss", "nonfinite_grad", "nonfinite_update", "guard_error"}
STEPS, NAN_AT, BATCH = 6, 3, 4


def tensors(modules: Iterable[nn.Module], optimizers: Iterable[Any]) -> list[Tensor]:
    """Copies of the parameters, buffers and optimizer state (dense)."""
    out: list[Tensor] = []
    for module in modules:
        out += [t.detach().clone() for t in module.state_dict(keep_vars=True).values()]
    for opt in optimizers:
        inner = next(
            (getattr(opt, a) for a in ("optim", "optimizer", "base_optimizer") if hasattr(opt, a)),
            opt,
        )  # (a wrapper's own scratch state, SAM's ``old_p``, is not the model's)
        for state in inner.state.values():
            out += [v.detach().clone() for v in state.values() if isinstance(v, Tensor)]
    return [t.to_dense() if t.is_sparse else t for t in out]


def same(a: Sequence[Tensor], b: Sequence[Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def finite(ts: Sequence[Tensor]) -> bool:
    return all(bool(torch.isfinite(t.float()).all()) for t in ts if t.is_floating_point())


@dataclass
class Ctx:
    """One training's settings, and what it captured."""

    tmp: Path
    monitored: bool
    nan_at: int = -1
    micro: int = 0  # which micro-batch of the step is NaN
    now: int = -1  # the step in flight
    at_micro: int = 0  # its micro-batch
    before: list[Tensor] | None = None  # the state as step `nan_at` began
    after: list[Tensor] | None = None  # ... and as the next began (or the training ended)
    final: list[Tensor] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # each micro-batch's, where noted

    @property
    def jsonl(self) -> Path:
        return self.tmp / "stability.jsonl"

    def begin(self, step: int, modules: Sequence[nn.Module], optimizers: Sequence[Any]) -> None:
        """A micro-batch of `step` begins (before its forward)."""
        self.at_micro = self.at_micro + 1 if step == self.now else 0
        self.now = step
        if step == self.nan_at and self.before is None:
            self.before = tensors(modules, optimizers)
        if step > self.nan_at >= 0 and self.after is None:
            self.after = tensors(modules, optimizers)

    def finish(self, modules: Sequence[nn.Module], optimizers: Sequence[Any]) -> None:
        self.final = tensors(modules, optimizers)
        if self.after is None and self.now >= self.nan_at:  # (not a fit that ends before it)
            self.after = self.final

    def bad(self) -> bool:
        """The model's output is NaN now (step `nan_at`, micro-batch `micro`)."""
        return self.now == self.nan_at and self.at_micro == self.micro

    def nan(self, module: nn.Module) -> None:
        """`module`'s output turns NaN at step `nan_at`."""

        def hook(mod: nn.Module, args: Any, out: Any) -> Any:
            return out * math.nan if self.bad() else None

        module.register_forward_hook(hook)

    def batches(self, steps: int = STEPS, accumulate: int = 1, nan_input: bool = False) -> Any:
        """Fixed batches (x: 4 features, y: 1); with `nan_input`, step `nan_at`'s micro-batch
        `micro` has a NaN input."""
        g = torch.Generator().manual_seed(0)
        out = []
        for i in range(steps * accumulate):
            x, y = torch.randn(BATCH, 4, generator=g), torch.randn(BATCH, 1, generator=g)
            if nan_input and i == self.nan_at * accumulate + self.micro:
                x = x * math.nan
            out.append((x, y))
        return out


class Net(nn.Module):
    """Linear → LayerNorm → GELU → Linear (a BatchNorm instead of the LayerNorm with `bn`)."""

    def __init__(self, bn: bool = False, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, width)
        self.norm: nn.Module = nn.BatchNorm1d(width) if bn else nn.LayerNorm(width)
        self.b = nn.Linear(width, 1)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.b(nn.functional.gelu(self.norm(self.a(x))))
        return out


def mse(out: Tensor, y: Tensor) -> Tensor:
    return ((out.float() - y.float()) ** 2).mean()


@dataclass
class Trained:
    ctx: Ctx
    front: Any
    lines: list[str]
    rows: list[dict[str, Any]]


def train(run: Callable[[Ctx], Any], ctx: Ctx) -> Trained:
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger, keep = logging.getLogger("stabilizer"), Keep(logging.INFO)
    logger.addHandler(keep)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            front = run(ctx)
    finally:
        logger.removeHandler(keep)
        logger.setLevel(level)
    rows = [json.loads(r) for r in ctx.jsonl.read_text().splitlines()] if ctx.jsonl.exists() else []
    return Trained(ctx, front, lines, rows)


def check(
    run: Callable[[Ctx], Any],
    tmp: Path,
    identical: bool = True,
    micro: int = 0,
    optimizers: int = 1,
    scaler_skips: int = 0,
    fits: int = 1,
) -> dict[str, Trained]:
    """The three trainings of `run` (see the module); `identical`: the healthy run must end
    bit-identical to the one without the monitor (a deterministic setup); `optimizers`: the
    optimizer steps of one block (each skipped at the NaN); `scaler_skips`: the steps an fp16
    grad scaler skips in the healthy run (its first scales overflow: its normal business)."""
    bare = train(run, Ctx(tmp / "bare", monitored=False))
    healthy = train(run, Ctx(tmp / "healthy", monitored=True))
    if identical:
        assert same(bare.ctx.final, healthy.ctx.final), "healthy run differs from the bare run"
    assert finite(healthy.ctx.final)
    assert healthy.front.skipped_steps == scaler_skips, "a healthy step was skipped"
    assert not [f for f in healthy.front.findings if f.kind in NAN], healthy.front.findings
    claims_true(healthy, scaler_skips, fits)
    nan = train(run, Ctx(tmp / "nan", monitored=True, nan_at=NAN_AT, micro=micro))
    ctx = nan.ctx
    assert ctx.before is not None and ctx.after is not None
    assert same(ctx.before, ctx.after), "the NaN step changed the state"
    assert finite(ctx.final), "the state ended non-finite"
    skipped = scaler_skips + optimizers
    assert nan.front.skipped_steps == skipped, f"skipped {nan.front.skipped_steps}"
    claims_true(nan, skipped, fits)
    return {"bare": bare, "healthy": healthy, "nan": nan}


def claims_true(t: Trained, skipped: int, fits: int = 1) -> None:
    """The console's end line, the JSONL and the front end say the same about what was
    skipped; "weights intact" only beside a skipped step; nothing says the weights are not."""
    ends = [line for line in t.lines if line.startswith("stabilizer: done at step")]
    assert len(ends) == fits, t.lines
    ends = ends[-1:]
    plural = "step" if skipped == 1 else "steps"
    assert f"{skipped} {plural} skipped" in ends[0], ends[0]
    if skipped:
        assert "weights checked finite at the end" in ends[0], ends[0]
    assert not any("NOT intact" in line for line in t.lines), t.lines
    failed = [line for line in t.lines if "Error(" in line or " failed" in line]
    assert not failed, failed  # (the monitor's own parts all ran)
    intact = [line for line in t.lines if "step skipped, weights intact" in line]
    assert len(intact) <= skipped, t.lines
    assert not any("was applied" in line for line in t.lines if skipped and "nonfinite" in line)
    if t.rows:
        end = [r for r in t.rows if r["type"] == "end"]
        assert end and end[-1]["skipped"] == skipped, end
        flagged = [  # (a second optimizer's keys are "opt2/...")
            (r["step"], k) for r in t.rows if r["type"] == "step"
            for k, v in r["values"].items() if k.split("/")[-1] == "skipped" and v == 1
        ]  # fmt: skip
        assert len(flagged) == skipped, flagged
    else:
        raise AssertionError("no JSONL written")
