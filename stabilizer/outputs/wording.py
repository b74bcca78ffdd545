"""How a finding reads, the same on the console, in TensorBoard and in the reports.

Two rules every output follows:

- `observation`: a detector's message ends with its short advice after the last ``": "``
  (``"... back after 4 steps: clip gradients (norm 1.0)"``). An output that lists the remedies
  on their own shows the observation only, so that one remedy is said once.
- `applicable_remedies`: the remedies that fit the run. "Skip the step" is no advice when the
  step was skipped (by the guard or a grad scaler); fp32 islands and fp32 master weights are
  no advice in an fp32 run.
"""

from __future__ import annotations

from collections.abc import Iterable

from stabilizer.core.records import Finding

__all__ = ["LOW_PRECISION_REMEDIES", "applicable_remedies", "observation"]

# Kinds whose message is "<observation>: <advice>", the advice repeating `Finding.remedies`.
_ADVICE_AFTER_COLON = frozenset(
    {
        "loss_spike",
        "grad_spike",
        "clip_saturation",
        "nonfinite_loss",
        "nonfinite_grad",
        "nonfinite_update",
        "fp16_overflow",
        "overflow_risk",
        "depth_imbalance",
    }
)

# The first words of the detectors' advice: a tail that starts otherwise is no advice.
_ADVICE_VERBS = frozenset(
    {"clip", "skip", "roll", "train", "switch", "lower", "keep", "run", "move", "warm", "halve"}
)

LOW_PRECISION_REMEDIES = frozenset({"upcast_to_fp32", "mixed_precision"})
"""Remedies that only help when some of the computation runs in 16 bits."""


def observation(finding: Finding) -> str:
    """The message without the detector's advice, when the remedies carry that advice.

    ``"loss spiked from 2.5 to 7.5 (3.0x) at step 121, back after 8 steps"`` for the message
    ``"...back after 8 steps: clip gradients"``. A finding without remedies keeps its message
    whole: there the advice is said nowhere else.
    """
    if finding.kind not in _ADVICE_AFTER_COLON or not finding.remedies:
        return finding.message
    message = finding.message
    for sep in (": ", "; "):  # "<what>: <advice>" or "<what>: <so what>; <advice>"
        head, found, tail = message.rpartition(sep)
        if found and head and tail.split(" ", 1)[0] in _ADVICE_VERBS:
            return head
    return message


def applicable_remedies(
    remedies: Iterable[str], *, skipped: bool = False, low_precision: bool | None = None
) -> tuple[str, ...]:
    """The remedies that fit the run, in their order, each once.

    Args:
        remedies: Remedy names, most useful first.
        skipped: Whether the optimizer step was skipped already (``skip_step`` is then done).
        low_precision: Whether the run computes in fp16 or bf16 (``False``: fp32, where the
            `LOW_PRECISION_REMEDIES` do nothing); ``None`` when not known (all are kept).
    """
    dropped = {"skip_step"} if skipped else set()
    if low_precision is False:
        dropped |= LOW_PRECISION_REMEDIES
    return tuple(name for name in dict.fromkeys(remedies) if name not in dropped)
