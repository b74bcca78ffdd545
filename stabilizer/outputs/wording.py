"""How a finding reads, the same on the console, in TensorBoard and in the reports.

Two rules every output follows:

- `observation`: an output that lists a finding's remedies shows what was seen
  (`Finding.seen`) without its advice, which the remedies say again, so that one remedy is said
  once; a finding without remedies shows its whole message.
- `applicable_remedies`: the remedies that fit the run. "Skip the step" is no advice when the
  step was skipped (by the guard or a grad scaler); fp32 islands and fp32 master weights are
  no advice in an fp32 run.
"""

from __future__ import annotations

from collections.abc import Iterable

from stabilizer.core.records import Finding

__all__ = ["LOW_PRECISION_REMEDIES", "applicable_remedies", "observation"]

LOW_PRECISION_REMEDIES = frozenset({"upcast_to_fp32", "mixed_precision"})
"""Remedies that only help when some of the computation runs in 16 bits."""


def observation(finding: Finding) -> str:
    """What was seen, when the remedies carry the advice; else the whole message.

    ``"loss spiked from 2.5 to 7.5 (3.0x) at step 121, back after 8 steps"`` for the message
    ``"...back after 8 steps: clip gradients (norm 1.0)"``.
    """
    return finding.seen if finding.remedies else finding.message


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
