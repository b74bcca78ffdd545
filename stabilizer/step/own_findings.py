"""The monitor's own findings of a step: what no detector can see in a record.

A step the guard could not check (critical: its update was skipped unchecked), an LR that is
non-finite or negative (the cause is known: no replay), values found non-finite in the weights
(critical: the weights are not intact). Each is built here from the step as it ended
(`stabilizer.step.step.OptimizerStep`), on a bad step only.
"""

from __future__ import annotations

from collections.abc import Sequence

from stabilizer.core.kinds import GUARD_ERROR, NONFINITE_UPDATE
from stabilizer.core.records import Finding, Severity
from stabilizer.core.remedies import ROLLBACK, SKIP_STEP

from .guard import BAD_LR, UNCHECKED
from .step import OptimizerStep

__all__ = ["first_bad", "weights_not_intact"]


def weights_not_intact(step: int, first: str, after: bool) -> Finding:
    """The critical finding of weights found non-finite (`first`: the first such tensor),
    before `step` or after the last step."""
    when = "after the last step" if after else f"before step {step}"
    message = (
        f"non-finite values in the weights {when} ({first}): an update that was let through, "
        "or code outside the optimizer, made them so; the weights are NOT intact. Resume "
        "from the last good checkpoint, and see docs/protection.md for what the guard "
        "cannot see"
    )
    return Finding(
        NONFINITE_UPDATE, step, step, Severity.CRITICAL, message,
        {"checked_step": float(step)}, ("optimizer",), (ROLLBACK,),
    )  # fmt: skip


def first_bad(step: OptimizerStep) -> Sequence[Finding]:
    """The findings of a first bad step that only the monitor knows (no replay needed)."""
    if step.reason == UNCHECKED or not step.checked:
        m = step.measurement
        error = m.error if m is not None else "not measured"
        message = f"the guard could not check this step ({error}): its update was skipped"
        unchecked = Finding(
            kind=GUARD_ERROR, step=step.step, end_step=step.step, severity=Severity.CRITICAL,
            seen=message,
        )  # fmt: skip
        return [unchecked]
    if step.reason == BAD_LR and step.measurement is not None:  # known cause: no replay
        lrs = [lr for lr in step.measurement.lrs if lr is not None]
        message = (
            f"the learning rate is non-finite or negative at step {step.step} (param groups: "
            f"{', '.join(f'{lr:g}' for lr in lrs)}): the update would be too; step skipped "
            "before the optimizer ran. Check the LR scheduler (a division by a zero step count, "
            "a NaN read from a config)"
        )
        evidence = {f"lr_{i}": lr for i, lr in enumerate(lrs)}
        bad_lr = Finding(
            NONFINITE_UPDATE, step.step, step.step, Severity.ERROR, message, evidence,
            ("optimizer",), (SKIP_STEP,),
        )  # fmt: skip
        return [bad_lr]
    return []
