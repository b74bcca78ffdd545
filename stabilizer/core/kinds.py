"""Every finding kind, one row each: the one place a kind's facts live.

A row says what a kind is called, how the reports title it and what usually causes it, which
detector emits it, what to do about it (the remedies in order, the one the ``auto`` policy
applies), and how the outputs treat it. Modules read a kind's facts here (`kind_of`) and name
kinds by the constants below, never by a string of their own. Adding a detector is its file in
`stabilizer.core.detectors` plus its rows here: the registry finds it by the rows' `detector`.

Row order matters twice: the detectors run in the order of their first rows, and within a
`family` an earlier row titles the episode.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .records import Severity
from .remedies import (
    AUTO_REMEDIES,
    CLIP_GRADIENTS,
    MIXED_PRECISION,
    ROLLBACK,
    SCALE_LR,
    SKIP_STEP,
    SWAP_TO_PRE_LN,
    UPCAST_TO_FP32,
)

__all__ = [
    "CAUSAL_LEAK",
    "CLIP_SATURATION",
    "CONFIG_RISK",
    "DEPTH_IMBALANCE",
    "DIVERGED",
    "DIVERGENCE",
    "FP16_OVERFLOW",
    "GRAD_SPIKE",
    "GUARD_ERROR",
    "IN_THE_LOSS",
    "KINDS",
    "LIVE_ONLY",
    "LOSS_SPIKE",
    "NONFINITE_GRAD",
    "NONFINITE_HELD",
    "NONFINITE_LOSS",
    "NONFINITE_UPDATE",
    "OVERFLOW_RISK",
    "REMEDY_APPLIED",
    "REMEDY_RESULT",
    "ROOT_CAUSE",
    "STALL",
    "TABLE",
    "TRAINER_SAID",
    "Kind",
    "detector_names",
    "family_rank",
    "kind_of",
]

NONFINITE_LOSS = "nonfinite_loss"
NONFINITE_GRAD = "nonfinite_grad"
NONFINITE_UPDATE = "nonfinite_update"
NONFINITE_HELD = "nonfinite_held"
LOSS_SPIKE = "loss_spike"
DIVERGENCE = "divergence"
DIVERGED = "diverged"
GRAD_SPIKE = "grad_spike"
CLIP_SATURATION = "clip_saturation"
FP16_OVERFLOW = "fp16_overflow"
OVERFLOW_RISK = "overflow_risk"
DEPTH_IMBALANCE = "depth_imbalance"
STALL = "stall"
ROOT_CAUSE = "root_cause"
CONFIG_RISK = "config_risk"
CAUSAL_LEAK = "causal_leak"
REMEDY_APPLIED = "remedy_applied"
REMEDY_RESULT = "remedy_result"
GUARD_ERROR = "guard_error"
TRAINER_SAID = "trainer_said"

IN_THE_LOSS = "in_loss"
"""A root cause's evidence key: 1 when every module output was finite (the NaN is the loss's)."""

_SPIKE, _NAN = "spike", "nonfinite"  # the families
_ALL_REMEDIES = AUTO_REMEDIES


@dataclass(frozen=True)
class Kind:
    """What the package knows of one finding kind.

    Args:
        name: The `Finding.kind` value.
        title: A short name for its episode in the reports (``"loss spike"``).
        cause: The usual cause, one sentence without a final period.
        detector: The registry name of the detector that emits it (its module in
            `stabilizer.core.detectors`); None for the live monitor's own findings.
        remedies: What its finding suggests, most useful first (`records.REMEDIES` names).
        auto: The remedy the ``auto`` policy applies for it, once; None: none.
        rollback_at: The ``auto`` policy rolls back at a finding of this severity or worse.
        refutes: Remedies that did not work when a finding of this kind comes back (at WARNING
            or worse) while the ``auto`` policy watches them.
        family: Kinds that one event raises together share a family: one episode in the reports.
        live_only: Only the run itself can know it (the live monitor, or the trainer's own words
            in its log): kept from the log, never replayed, and each finding is an event of its
            own, never an update of an episode.
        nan: It tells of a NaN/Inf in the step (the console says what became of the step; a NaN
            made in the loss changes the cause and the remedies).
        scaler_skips: The grad scaler skipped every step of such a finding.
        outcome: The reports say whether the loss came back finite after it.
        action: It reports what the monitor did (a remedy applied, a remedy checked), not a
            symptom: the console prints each one, and its remedies name what was done.
        setup_up_to: At or below this severity it is advice on the set-up, not an event of the
            training; None: never.
        noun: How the console counts its repeats (``"NaN/Inf loss at 5 more steps"``).
        cause_not_fp16: The cause when the log shows no fp16 loss scale ("" for `cause`).
        cause_fp32: The cause when the run's header says fp32 ("" for `cause_not_fp16`).
        remedy_text: How a remedy reads after this kind, where that differs from its usual text.
    """

    name: str
    title: str
    cause: str
    detector: str | None = None
    remedies: tuple[str, ...] = ()
    auto: str | None = None
    rollback_at: Severity | None = None
    refutes: tuple[str, ...] = ()
    family: str | None = None
    live_only: bool = False
    nan: bool = False
    scaler_skips: bool = False
    outcome: bool = False
    action: bool = False
    setup_up_to: Severity | None = None
    noun: str = ""
    cause_not_fp16: str = ""
    cause_fp32: str = ""
    remedy_text: Mapping[str, str] = field(default_factory=dict)

    @property
    def count_noun(self) -> str:
        """`noun`, or the kind's name."""
        return self.noun or self.name

    def advises_setup(self, severity: Severity) -> bool:
        """Whether its finding at `severity` is advice on the set-up (the preflight's
        ``config_risk``), not an episode of the training (`setup_up_to`)."""
        return self.setup_up_to is not None and severity <= self.setup_up_to


TABLE: tuple[Kind, ...] = (
    Kind(
        NONFINITE_LOSS,
        "non-finite loss (NaN/Inf)",
        "an fp16 overflow, a softmax computed without max-subtraction, or LayerNorm computed in "
        "fp16",
        detector="nonfinite",
        remedies=(SKIP_STEP, UPCAST_TO_FP32, ROLLBACK),
        auto=UPCAST_TO_FP32,
        rollback_at=Severity.CRITICAL,
        refutes=_ALL_REMEDIES,
        family=_NAN,
        nan=True,
        outcome=True,
        noun="NaN/Inf loss",
        cause_not_fp16="values past their dtype's range, a softmax computed without "
        "max-subtraction, or LayerNorm in low precision",
        cause_fp32="values past even fp32's range (an activation or logit that grew without "
        "bound), a softmax computed without max-subtraction, or a log of 0 or a division by 0",
    ),
    Kind(
        NONFINITE_GRAD,
        "non-finite gradients (NaN/Inf)",
        "an overflow in the backward pass: fp16 range exceeded, a softmax without "
        "max-subtraction, or LayerNorm in fp16",
        detector="nonfinite",
        remedies=(SKIP_STEP, UPCAST_TO_FP32, ROLLBACK),
        auto=UPCAST_TO_FP32,
        rollback_at=Severity.CRITICAL,
        refutes=_ALL_REMEDIES,
        family=_NAN,
        nan=True,
        outcome=True,
        noun="NaN/Inf gradients",
        cause_not_fp16="an overflow in the backward pass: a softmax without max-subtraction, "
        "a division by a tiny norm, or LayerNorm in low precision",
        cause_fp32="an overflow in the backward pass: a softmax without max-subtraction, "
        "a division by a tiny norm, or an activation that grew without bound",
    ),
    Kind(
        NONFINITE_UPDATE,
        "non-finite optimizer update",
        "the optimizer's own arithmetic overflowed from finite gradients: in pure fp16, AdamW's "
        "eps underflows to 0 and a weight whose gradient was always 0 gets 0/0",
        detector="nonfinite",
        remedies=(SKIP_STEP, MIXED_PRECISION),
        rollback_at=Severity.CRITICAL,
        family=_NAN,
        nan=True,
    ),
    Kind(
        DIVERGENCE,
        "loss divergence",
        "the learning rate is too high for this stage of training, or a spike knocked the run "
        "into a worse region it cannot leave",
        detector="loss_spike",
        remedies=(ROLLBACK, SCALE_LR, CLIP_GRADIENTS),
        rollback_at=Severity.ERROR,
        refutes=(CLIP_GRADIENTS, SCALE_LR, SWAP_TO_PRE_LN, ROLLBACK),
        family=_SPIKE,
    ),
    Kind(
        DIVERGED,
        "diverged beyond any healthy level",
        "the run blew up (an LR far too high, unnormalised inputs or targets, a loss summed "
        "where it should be averaged): its gradient norm is orders of magnitude beyond any "
        "healthy run's from the first record on, or its perplexity worse than a uniform guess",
        detector="diverged",
        remedies=(ROLLBACK, SCALE_LR, CLIP_GRADIENTS),
    ),
    Kind(
        LOSS_SPIKE,
        "loss spike",
        "one batch with an outsized gradient pushed the weights off course; the run recovered",
        detector="loss_spike",
        remedies=(CLIP_GRADIENTS, ROLLBACK),
        auto=CLIP_GRADIENTS,
        family=_SPIKE,
    ),
    Kind(
        GRAD_SPIKE,
        "gradient-norm spike",
        "one batch with an outsized gradient; such spikes often come just before a loss spike",
        detector="grad_spike",
        remedies=(CLIP_GRADIENTS, SKIP_STEP),
        auto=CLIP_GRADIENTS,
        family=_SPIKE,
    ),
    Kind(
        CLIP_SATURATION,
        "clipping saturated",
        "the learning rate is too high: clipping fires on most steps and has become the "
        "optimizer's step-size control",
        detector="grad_spike",
        remedies=(SCALE_LR,),
        auto=SCALE_LR,
        refutes=(SCALE_LR,),
    ),
    Kind(
        FP16_OVERFLOW,
        "fp16 overflow cascade",
        "values exceed the fp16 range (65504) step after step, so the dynamic loss scaler skips "
        "steps and cannot find a scale that works",
        detector="fp16_overflow",
        remedies=(UPCAST_TO_FP32, SKIP_STEP),
        auto=UPCAST_TO_FP32,
        family=_NAN,
        scaler_skips=True,
    ),
    Kind(
        OVERFLOW_RISK,
        "activations near the fp16 limit",
        "activations grow towards the fp16 maximum (65504): an overflow in the making",
        detector="overflow_risk",
        remedies=(UPCAST_TO_FP32,),
        auto=UPCAST_TO_FP32,
    ),
    Kind(
        DEPTH_IMBALANCE,
        "starved layers (depth imbalance)",
        "post-LN residual blocks in a deep stack: the gradient vanishes towards one end of it",
        detector="depth_imbalance",
        remedies=(SWAP_TO_PRE_LN, SCALE_LR),
        auto=SWAP_TO_PRE_LN,
        refutes=(SWAP_TO_PRE_LN,),
    ),
    Kind(
        STALL,
        "not learning (stall)",
        "the loss has not moved from where it started: an LR far too high or far too low, "
        "frozen parameters, or labels that do not match the inputs",
        detector="stall",
        remedies=(SCALE_LR,),
        remedy_text={
            # A run that does not learn may have an LR far too low as well as far too high.
            SCALE_LR: "try the learning rate 10x lower and 10x higher: a run that does not "
            "learn has one far off",
        },
    ),
    Kind(
        ROOT_CAUSE,
        "origin of the NaN/Inf",
        "the failing step replayed under hooks: the first module whose output (or input "
        "gradient) became non-finite",
        family=_NAN,
        live_only=True,
        nan=True,
        noun="root cause",
    ),
    Kind(
        CONFIG_RISK,
        "risky configuration",
        "a setting known to make Transformer training unstable",
        live_only=True,
        setup_up_to=Severity.CRITICAL,
    ),
    Kind(
        CAUSAL_LEAK,
        "causal leak",
        "the model sees future tokens (a wrong attention mask or target shift): the loss is "
        "too good to be true",
        live_only=True,
        setup_up_to=Severity.INFO,
    ),
    Kind(
        REMEDY_APPLIED,
        "remedy applied",
        "the monitor's `auto` policy changed the run to fix a finding",
        live_only=True,
        action=True,
    ),
    Kind(
        REMEDY_RESULT,
        "remedy checked",
        "the `auto` policy watched a remedy it applied: whether the failure it answered came back",
        live_only=True,
        action=True,
        noun="remedy result",
    ),
    Kind(
        NONFINITE_HELD,
        "NaN/Inf held by design",
        "the model holds NaN/Inf on purpose (a -inf attention mask, quantization observers' "
        "+-inf, a running maximum that starts at -inf, an unused uninitialised parameter): "
        "noted when first seen, never judged; only a value that turns non-finite is",
        live_only=True,
        setup_up_to=Severity.INFO,
    ),
    Kind(
        GUARD_ERROR,
        "step not checked",
        "the monitor could not measure the step (an internal error, or a setup its probes cannot "
        "read): the guard skipped its update rather than let an unchecked one through",
        remedies=(SKIP_STEP,),
        live_only=True,
    ),
    Kind(
        TRAINER_SAID,
        "the trainer said so",
        "the trainer's own message reports trouble (it stopped on a NaN, its loss scale hit its "
        "floor, it saw a spike): read from its log beside the numbers "
        "(`stabilizer.replay.readers.words`)",
        live_only=True,
    ),
)
"""Every known kind, in the order above."""

_BY_NAME = {kind.name: kind for kind in TABLE}

KINDS: tuple[str, ...] = tuple(_BY_NAME)
"""Known `Finding.kind` values (not enforced: other components may add kinds)."""

LIVE_ONLY: frozenset[str] = frozenset(kind.name for kind in TABLE if kind.live_only)
"""Kinds only the live monitor can make: read from its log, never replayed, never updates."""

_RANK: dict[str, tuple[str, int]] = {
    kind.name: (family, -order)
    for family in dict.fromkeys(k.family for k in TABLE if k.family)
    for order, kind in enumerate(k for k in TABLE if k.family == family)
}


def kind_of(name: str) -> Kind:
    """The row of ``name``; a kind not in the table gets its own name and a neutral cause."""
    found = _BY_NAME.get(name)
    if found is not None:
        return found
    return Kind(name, name.replace("_", " "), "not in the advice table: see the message")


def family_rank(name: str) -> tuple[str, int] | None:
    """The family of ``name`` and its precedence in it (the kind that titles highest), or None
    for a kind of no family."""
    return _RANK.get(name)


def detector_names() -> tuple[str, ...]:
    """The registry names of the detectors the rows name, in the order of their first rows."""
    return tuple(dict.fromkeys(kind.detector for kind in TABLE if kind.detector))
