"""`ClipWindow`: the clip-saturation rule of `GradSpike`, over the last steps' clipped flags."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from math import isfinite
from typing import Any

from stabilizer.core.kinds import CLIP_SATURATION, kind_of
from stabilizer.core.records import Finding, Severity
from stabilizer.core.signals import CLIP_VAL, CLIPPED, GRAD_NORM

from ._robust import finite

__all__ = ["ClipWindow", "clipped"]


def clipped(values: Mapping[str, float]) -> bool | None:
    """Whether clipping fired: ``clipped`` if logged, else ``grad_norm > clip_val``, else None."""
    flag = values.get(CLIPPED)
    if flag is not None and isfinite(flag):
        return flag >= 0.5
    norm, clip_val = finite(values, GRAD_NORM), finite(values, CLIP_VAL)
    return None if norm is None or clip_val is None else norm > clip_val


class ClipWindow:
    """The clipped flags of the last ``size`` steps and their sum; saturated above ``fraction``.

    One ``clip_saturation`` finding at onset (a full window clipped more than ``fraction`` of
    the time), re-armed when the clipped fraction falls under half of ``fraction``.
    """

    def __init__(self, size: int, fraction: float) -> None:
        self.size, self.fraction = size, fraction
        self.flags: deque[tuple[int, int]] = deque()  # (step, 1 if clipped else 0), oldest first
        self.count = 0  # sum of the flags
        self.saturated = False

    def update(self, step: int, values: Mapping[str, float]) -> list[Finding]:
        """Feed one record; the finding when clipping has just saturated."""
        was = clipped(values)
        if was is None:
            return []
        flags, bit = self.flags, 1 if was else 0
        if len(flags) >= self.size:
            self.count -= flags.popleft()[1]
        flags.append((step, bit))
        self.count += bit
        fraction = self.count / len(flags)  # as the mean of the flags: a sum of ints is exact
        if self.saturated:
            self.saturated = fraction > self.fraction / 2
            return []
        if len(flags) < self.size or fraction <= self.fraction:
            return []
        self.saturated = True
        window, start = len(flags), flags[0][0]
        # A log that prints every N steps has N steps to a record: say records, not steps.
        span = f"{window} steps" if step - start + 1 == window else f"{window} records"
        evidence = {"fraction": fraction, "window": window}
        clip_val = finite(values, CLIP_VAL)
        if clip_val is not None:
            evidence["clip_val"] = clip_val
        finding = Finding(
            kind=CLIP_SATURATION,
            step=start,
            end_step=step,
            severity=Severity.WARNING,
            seen=f"{fraction:.0%} of the last {span} were clipped",
            evidence=evidence,
            remedies=kind_of(CLIP_SATURATION).remedies,
            advice="lower the LR instead",
        )
        return [finding]

    def state(self) -> dict[str, Any]:
        """The flags as ``[step, 0/1]`` pairs and whether saturated."""
        return {"clips": [list(pair) for pair in self.flags], "saturated": self.saturated}

    def load(self, state: Mapping[str, Any]) -> None:
        """Restore from `state`."""
        flags = [(int(s), int(f)) for s, f in state["clips"]][-self.size :]
        self.flags, self.count = deque(flags), sum(f for _, f in flags)
        self.saturated = bool(state["saturated"])
