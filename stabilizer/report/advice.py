"""What each finding means and what to do about it: the one table the reports read from.

The causes and remedies are those of the field's table of failures (a loss spike that recovers, a
NaN that never recovers, a deep stack that does not converge) and of the detectors' own rules.
Every kind of `stabilizer.core.records.KINDS` and every remedy of
`stabilizer.core.records.REMEDIES` has an entry; a kind or remedy added elsewhere without one
falls back to its own name.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ADVICE", "REMEDY_TEXT", "Advice", "advice_for", "remedy_text"]


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
        "fp16; once a NaN update reaches the weights the run never recovers",
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


def advice_for(kind: str) -> Advice:
    """The advice for a finding kind; an unknown kind gets its own name and a neutral cause."""
    found = ADVICE.get(kind)
    if found is not None:
        return found
    return Advice(kind.replace("_", " "), "not in the advice table: see the message")


def remedy_text(name: str) -> str:
    """The action a remedy name stands for; an unknown name is returned as it is."""
    return REMEDY_TEXT.get(name, name)
