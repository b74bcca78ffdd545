"""`Probe`: a non-finite gradient judged by what the run did next, for `NonFinite`.

A mixed-precision scaler (torch's ``GradScaler``, apex, DeepSpeed, mmcv's fp16 hook) starts with
a scale that overflows and grows it again every few thousand steps: each time, one step's
gradient norm is inf or NaN, the scaler skips that step and halves its scale. A log that prints
the norm but not the scale shows an isolated ``inf`` the run steps past: the next loss finite and
where it was, the next norm finite. That is the scaler probing, not a failure (the HF Trainer's
``trainer_state.json`` at an fp16 start-up with LR 0; build-nanogpt's fp16 ``norm: inf``;
TableMASTER-mmocr#32, whose maintainer answers "caused by mixed precision training"). A
non-finite norm the run does not step past — the next norm non-finite too, the loss NaN or out of
its band, another one a few records later — is the failure it looks like.

So where the run may compute in fp16 (its header says so, or nothing says it does not), the first
non-finite gradient norm of an episode with a finite loss is held one record, and judged then:
stepped past when the next loss is within 1.5x of the losses beside it and before it, and the next
norm is finite.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from stabilizer.core.records import Finding, Severity

__all__ = ["Probe"]

_BAND = 1.5  # a next loss above this multiple of the losses beside the norm and before it: out
_REPEAT = 10  # a second non-finite norm within this many records is no probe: it repeats


class Probe:
    """The held finding of a non-finite gradient norm, the loss beside it (its band), and how
    many records ago the run last stepped past one."""

    def __init__(self) -> None:
        self.held: Finding | None = None  # the first finding of an episode, held one record
        self.band = 0.0  # the losses beside the held norm and before it: the next within 1.5x
        self.recent = 0  # records left until a new non-finite norm may be a probe again

    def may_hold(self, loss: float | None, fp16: bool | None) -> bool:
        """Whether a non-finite gradient norm beside ``loss`` (finite or None) may be a probe:
        the run may compute in fp16 and no probe came in the last `_REPEAT` records."""
        return fp16 is not False and not self.recent and loss is not None

    def hold(self, finding: Finding, band: float) -> None:
        """Hold ``finding``, the first of an episode; ``band``: the larger of the finite losses
        beside its norm and of the record before."""
        self.held, self.band = finding, band

    def judge(self, loss: float | None, next_step: int) -> Finding:
        """The held finding, settled by a finite next record with ``loss``: INFO when the run
        stepped past it (the loss in its band), else the held ERROR."""
        held, self.held = self.held, None
        assert held is not None
        if loss is not None and loss > _BAND * self.band:
            return held  # the loss left its band: the step did harm
        self.recent = _REPEAT
        return replace(
            held,
            severity=Severity.INFO,
            seen=f"{held.seen}, and the run stepped past it (at step {next_step} the loss is "
            "finite and in its band, the gradient norm finite): a mixed-precision scaler "
            "skipping an overflowed step and lowering its scale (probing), not a failure",
            remedies=(),
            advice="",
        )

    def state(self) -> dict[str, Any]:
        """The held finding, its band and the records left, as plain data."""
        held = None if self.held is None else self.held.to_dict()
        return {"held": held, "band": self.band, "recent": self.recent}

    def load(self, state: Mapping[str, Any] | None) -> None:
        """Restore from `state` (None: a checkpoint of an earlier version: nothing held)."""
        state = state or {}
        held = state.get("held")
        self.held = None if held is None else Finding.from_dict(held)
        self.band, self.recent = float(state.get("band", 0.0)), int(state.get("recent", 0))
