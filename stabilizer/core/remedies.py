"""Every remedy, one row each: the one place a remedy's facts live.

A row says what a remedy is called, what to do in words, whether the ``auto`` policy can apply
it and whether that changes what the model computes, whether it only helps runs that compute in
16 bits, what ``auto`` tries next when it did not work, and what to do when nothing is left.
Modules read a remedy's facts here (`remedy`) and name remedies by the constants below, never
by a string of their own (tests/test_one_home.py keeps it so). Which remedy answers which
finding kind is the kinds table's (`stabilizer.core.kinds`), and which remedies fit a run is
`stabilizer.core.advice`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "AUTO_REMEDIES",
    "CLIP_GRADIENTS",
    "LOW_PRECISION_REMEDIES",
    "LR_WARMUP",
    "MIXED_PRECISION",
    "REMEDIES",
    "REWRITES",
    "ROLLBACK",
    "SCALE_LR",
    "SKIP_STEP",
    "SWAP_TO_PRE_LN",
    "TABLE",
    "UPCAST_TO_FP32",
    "Remedy",
    "remedy",
]

CLIP_GRADIENTS = "clip_gradients"
UPCAST_TO_FP32 = "upcast_to_fp32"
SWAP_TO_PRE_LN = "swap_to_pre_ln"
SKIP_STEP = "skip_step"
ROLLBACK = "rollback"
SCALE_LR = "scale_lr"
LR_WARMUP = "lr_warmup"
MIXED_PRECISION = "mixed_precision"


@dataclass(frozen=True)
class Remedy:
    """What the package knows of one remedy.

    Args:
        name: The name a finding's ``remedies`` use.
        text: What to do, in words.
        text_bf16: The words in a run that is in bf16 already, where they differ.
        auto: The ``auto`` policy can apply it (`stabilizer.step.auto`).
        rewrite: Applying it changes what the model computes: ``auto`` rewrites only a model
            trained from scratch, unless the user names it.
        low_precision: It only helps where some of the computation runs in 16 bits.
        next: What ``auto`` tries next when it did not work (None: nothing; a clean stop).
        last_resort: What to do when ``auto`` has nothing left after it.
    """

    name: str
    text: str
    text_bf16: str = ""
    auto: bool = False
    rewrite: bool = False
    low_precision: bool = False
    next: str | None = None
    last_resort: str = "restart lower"


TABLE: tuple[Remedy, ...] = (
    Remedy(
        CLIP_GRADIENTS,
        "clip the global gradient norm to 1.0",
        auto=True,
        next=SCALE_LR,
        last_resort="lower the LR or find the batches behind the spikes",
    ),
    Remedy(
        UPCAST_TO_FP32,
        "run softmax and LayerNorm in fp32 (fp32 islands), or switch to bf16",
        text_bf16="run softmax and LayerNorm in fp32 (fp32 islands)",
        auto=True,
        rewrite=True,
        low_precision=True,
        next=ROLLBACK,
        last_resort="train in bf16 or fp32, or find the module that overflows (root_cause)",
    ),
    Remedy(
        SWAP_TO_PRE_LN,
        "move to pre-LN residual blocks and keep the LR warmup",
        auto=True,
        rewrite=True,
        last_resort="restart from scratch with pre-LN and LR warmup",
    ),
    Remedy(
        SKIP_STEP,
        "skip the step, so that a bad (NaN/Inf or outsized) update never reaches the weights",
    ),
    Remedy(
        ROLLBACK,
        "roll back to the last good checkpoint and step past the bad batch",
        auto=True,
        next=ROLLBACK,
        last_resort="restart from a checkpoint before the trouble with a lower LR",
    ),
    Remedy(
        SCALE_LR,
        "lower the learning rate",
        auto=True,
        next=ROLLBACK,
        last_resort="lower the peak LR and restart from a checkpoint before the trouble",
    ),
    Remedy(LR_WARMUP, "warm the learning rate up over the first few hundred steps"),
    Remedy(
        MIXED_PRECISION,
        "keep fp32 master weights (16-mixed/bf16-mixed) or raise the optimizer's eps (1e-8 is "
        "0 in fp16)",
        low_precision=True,
    ),
)
"""Every known remedy, in the order above."""

_BY_NAME = {r.name: r for r in TABLE}

REMEDIES: tuple[str, ...] = tuple(_BY_NAME)
"""Known remedy names for `stabilizer.core.records.Finding.remedies`."""

AUTO_REMEDIES: tuple[str, ...] = tuple(r.name for r in TABLE if r.auto)
"""The remedies the ``auto`` policy can apply (`AutoRemedies(allow=...)` names among them)."""

REWRITES: frozenset[str] = frozenset(r.name for r in TABLE if r.rewrite)
"""Remedies that change what the model computes."""

LOW_PRECISION_REMEDIES: frozenset[str] = frozenset(r.name for r in TABLE if r.low_precision)
"""Remedies that only help when some of the computation runs in 16 bits."""


def remedy(name: str) -> Remedy:
    """The row of ``name``; an unknown name gets its own name as its text."""
    return _BY_NAME.get(name) or Remedy(name, name)
