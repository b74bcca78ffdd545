"""What each finding means and what to do about it: the one table the reports read from.

The causes and remedies are those of the field's table of failures (a loss spike that recovers, a
NaN that never recovers, a deep stack that does not converge) and of the detectors' own rules.
Every kind of `stabilizer.core.records.KINDS` and every remedy of
`stabilizer.core.records.REMEDIES` has an entry; a kind or remedy added elsewhere without one
falls back to its own name.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from stabilizer.core.records import Finding
from stabilizer.outputs.wording import LOW_PRECISION_REMEDIES

__all__ = [
    "ADVICE",
    "REMEDY_TEXT",
    "Advice",
    "RunFacts",
    "advice_for",
    "cause_for",
    "fitting_remedies",
    "remedy_text",
]


@dataclass(frozen=True)
class Advice:
    """How the reports present one finding kind.

    Args:
        title: A short name for the episode (``"loss spike"``).
        cause: The usual cause, one sentence without a final period.
    """

    title: str
    cause: str


ADVICE: dict[str, Advice] = {
    "loss_spike": Advice(
        "loss spike",
        "one batch with an outsized gradient pushed the weights off course; the run recovered",
    ),
    "divergence": Advice(
        "loss divergence",
        "the learning rate is too high for this stage of training, or a spike knocked the run "
        "into a worse region it cannot leave",
    ),
    "nonfinite_loss": Advice(
        "non-finite loss (NaN/Inf)",
        "an fp16 overflow, a softmax computed without max-subtraction, or LayerNorm computed in "
        "fp16",
    ),
    "nonfinite_grad": Advice(
        "non-finite gradients (NaN/Inf)",
        "an overflow in the backward pass: fp16 range exceeded, a softmax without "
        "max-subtraction, or LayerNorm in fp16",
    ),
    "grad_spike": Advice(
        "gradient-norm spike",
        "one batch with an outsized gradient; such spikes often come just before a loss spike",
    ),
    "clip_saturation": Advice(
        "clipping saturated",
        "the learning rate is too high: clipping fires on most steps and has become the "
        "optimizer's step-size control",
    ),
    "fp16_overflow": Advice(
        "fp16 overflow cascade",
        "values exceed the fp16 range (65504) step after step, so the dynamic loss scaler skips "
        "steps and cannot find a scale that works",
    ),
    "overflow_risk": Advice(
        "activations near the fp16 limit",
        "activations grow towards the fp16 maximum (65504): an overflow in the making",
    ),
    "depth_imbalance": Advice(
        "starved layers (depth imbalance)",
        "post-LN residual blocks in a deep stack: the gradient vanishes towards one end of it",
    ),
    "stall": Advice(
        "not learning (stall)",
        "the loss has not moved from where it started: an LR far too high or far too low, "
        "frozen parameters, or labels that do not match the inputs",
    ),
    "nonfinite_update": Advice(
        "non-finite optimizer update",
        "the optimizer's own arithmetic overflowed from finite gradients: in pure fp16, AdamW's "
        "eps underflows to 0 and a weight whose gradient was always 0 gets 0/0",
    ),
    "root_cause": Advice(
        "origin of the NaN/Inf",
        "the failing step replayed under hooks: the first module whose output (or input "
        "gradient) became non-finite",
    ),
    "remedy_applied": Advice(
        "remedy applied",
        "the monitor's `auto` policy changed the run to fix a finding",
    ),
    "remedy_result": Advice(
        "remedy checked",
        "the `auto` policy watched a remedy it applied: whether the failure it answered came back",
    ),
    "config_risk": Advice(
        "risky configuration",
        "a setting known to make Transformer training unstable",
    ),
    "causal_leak": Advice(
        "causal leak",
        "the model sees future tokens (a wrong attention mask or target shift): the loss is "
        "too good to be true",
    ),
}
"""Title and usual cause by finding kind."""

REMEDY_TEXT: dict[str, str] = {
    "clip_gradients": "clip the global gradient norm to 1.0",
    "upcast_to_fp32": "run softmax and LayerNorm in fp32 (fp32 islands), or switch to bf16",
    "swap_to_pre_ln": "move to pre-LN residual blocks and keep the LR warmup",
    "skip_step": "skip the step, so that a bad (NaN/Inf or outsized) update never reaches the "
    "weights",
    "rollback": "roll back to the last good checkpoint and step past the bad batch",
    "scale_lr": "lower the learning rate",
    "lr_warmup": "warm the learning rate up over the first few hundred steps",
    "mixed_precision": "keep fp32 master weights (16-mixed/bf16-mixed) or raise the optimizer's "
    "eps (1e-8 is 0 in fp16)",
}
"""What to do, by remedy name (the names of `stabilizer.core.records.REMEDIES`)."""


@dataclass(frozen=True)
class RunFacts:
    """What a log tells about the run, beyond its findings.

    Args:
        fp16: A loss scale was logged (fp16 mixed precision); False: not known to be fp16.
        skipped: Spans of steps ``(first, last)`` in which an update was skipped (by the
            monitor's guard or a grad scaler).
        low_precision: Whether the run computed in 16 bits, from the run's header in
            ``stability.jsonl``: False for an fp32 run, None when the log does not say.
    """

    fp16: bool = False
    skipped: tuple[tuple[int, int], ...] = ()
    low_precision: bool | None = None

    def was_skipped(self, step: int) -> bool:
        """Whether the update of ``step`` was (as far as the log tells) skipped."""
        return any(first <= step <= last for first, last in self.skipped)


_IN_THE_LOSS = "every module output is finite"  # the root cause's words for a NaN in the loss
_NONFINITE = frozenset({"nonfinite_loss", "nonfinite_grad", "nonfinite_update", "root_cause"})
_LOSS_CAUSE = (
    "the loss computation or its inputs: every module output was finite, so look at the loss "
    "itself (a log of 0, a division by a count of 0, NaN labels or loss weights)"
)
_NOT_FP16_CAUSE = {
    "nonfinite_loss": "values past their dtype's range, a softmax computed without "
    "max-subtraction, or LayerNorm in low precision",
    "nonfinite_grad": "an overflow in the backward pass: a softmax without max-subtraction, "
    "a division by a tiny norm, or LayerNorm in low precision",
}
_FP32_CAUSE = {  # the run's header says fp32: no 16-bit range to blame
    "nonfinite_loss": "values past even fp32's range (an activation or logit that grew without "
    "bound), a softmax computed without max-subtraction, or a log of 0 or a division by 0",
    "nonfinite_grad": "an overflow in the backward pass: a softmax without max-subtraction, "
    "a division by a tiny norm, or an activation that grew without bound",
}


def in_the_loss(findings: Iterable[Finding]) -> bool:
    """Whether a root cause found the NaN/Inf outside every module (in the loss)."""
    return any(f.kind == "root_cause" and _IN_THE_LOSS in f.message for f in findings)


def cause_for(kind: str, findings: Sequence[Finding], facts: RunFacts) -> str:
    """The usual cause of ``kind``, as far as the episode's evidence and the run tell."""
    if kind in _NONFINITE and in_the_loss(findings):
        return _LOSS_CAUSE
    if facts.low_precision is False and kind in _FP32_CAUSE:
        return _FP32_CAUSE[kind]
    if not facts.fp16 and kind in _NOT_FP16_CAUSE:
        return _NOT_FP16_CAUSE[kind]
    if kind == "loss_spike":
        return _spike_cause(next(f for f in findings if f.kind == kind))
    return advice_for(kind).cause


def _spike_cause(spike: Finding) -> str:
    """A loss spike's cause as its evidence tells: one step up or several, recovered or not."""
    if spike.end_step is None or spike.end_step == spike.step:
        cause = "one batch with an outsized gradient pushed the weights off course"
    else:  # (a log may not hold every step: the span, not a count of bad steps)
        cause = (
            f"the loss stayed up from step {spike.step} to {spike.end_step}, not for one step: "
            "a run of bad batches (corrupt or mislabelled data, a bad shard), or one outsized "
            "update the weights took that long to undo"
        )
    recovered = spike.evidence.get("recovered", 1.0) >= 0.5
    return cause + ("; the run recovered" if recovered else "; not back by the end of the log")


def fitting_remedies(
    remedies: Sequence[str], findings: Sequence[Finding], facts: RunFacts
) -> tuple[str, ...]:
    """The remedies that the evidence supports, each once, in their order.

    A NaN made in the loss, or in a run whose header says fp32, gets no fp32 islands (nor bf16,
    nor fp32 master weights), as on the live console; ``skip_step`` is dropped where the step was
    skipped already.
    """
    dropped: set[str] = set()
    if in_the_loss(findings) or facts.low_precision is False:
        dropped |= LOW_PRECISION_REMEDIES
    nonfinite = [f for f in findings if f.kind in _NONFINITE or f.kind == "fp16_overflow"]
    if nonfinite and all(f.kind == "fp16_overflow" or facts.was_skipped(f.step) for f in nonfinite):
        dropped.add("skip_step")
    return tuple(name for name in dict.fromkeys(remedies) if name not in dropped)


def advice_for(kind: str) -> Advice:
    """The advice for a finding kind; an unknown kind gets its own name and a neutral cause."""
    found = ADVICE.get(kind)
    if found is not None:
        return found
    return Advice(kind.replace("_", " "), "not in the advice table: see the message")


_FOR_KIND = {
    # A run that does not learn may have an LR far too low as well as far too high.
    ("stall", "scale_lr"): "try the learning rate 10x lower and 10x higher: a run that does not "
    "learn has one far off",
}


def remedy_text(name: str, kind: str = "") -> str:
    """The action a remedy name stands for (after a finding of ``kind``, where that changes it);
    an unknown name is returned as it is."""
    return _FOR_KIND.get((kind, name)) or REMEDY_TEXT.get(name, name)
