"""`Fp16Overflow`: the fp16 grad scaler skipping step after step, its scale collapsing."""

from __future__ import annotations

from collections import deque
from typing import Any, ClassVar

from ..records import Finding, Severity, StepRecord
from ..signals import LOSS_SCALE, SKIPPED
from ._robust import finite
from .base import check_at_least

__all__ = ["Fp16Overflow"]


class Fp16Overflow:
    """An fp16 overflow cascade: the dynamic loss scaler cannot find a scale that works.

    Requires: ``loss_scale``; ``skipped`` (else a falling scale counts as a skipped step).
    Rule: a skip with ≥ `cascade` skips in a row, scale ÷ 2^`drop_pow` in `window`, or ≤ `floor`.

    A scaler probes: it doubles its scale every N good steps and halves it on an overflow, skipping
    that step. An isolated skip with the scale holding is therefore healthy and stays silent. So
    does start-up: torch and DeepSpeed start at 65536 and halve step after step until the scale
    fits; skips before the first good step are that calibration, only the floor rule applies. The
    finding is emitted when the cascade is recognised (the run may never leave it); later skips
    extend the episode silently, and `quiet` good records in a row close it.

    Args:
        cascade: Consecutive skipped steps that make a cascade.
        drop_pow: A fall of the scale by 2**drop_pow within `window` records makes a cascade.
        window: Records over which the fall of the scale is measured.
        floor: A skipped step at a scale at or below this is a cascade (gradients overflow even
            unscaled).
        quiet: Good (unskipped) records in a row that end an episode.
    """

    name: ClassVar[str] = "fp16_overflow"
    requires: ClassVar[tuple[str, ...]] = (LOSS_SCALE,)

    def __init__(
        self,
        cascade: int = 3,
        drop_pow: int = 5,
        window: int = 100,
        floor: float = 1.0,
        quiet: int = 50,
    ) -> None:
        check_at_least("cascade", cascade, 2)
        check_at_least("drop_pow", drop_pow, 1)
        check_at_least("window", window, 2)
        check_at_least("floor", floor, 0.0)
        check_at_least("quiet", quiet, 1)
        self.cascade, self.drop, self.floor, self.quiet = cascade, 2.0**drop_pow, floor, quiet
        self._window: deque[list[Any]] = deque(maxlen=window)  # [step, scale, skipped 0/1]
        self._prev: float | None = None  # scale of the previous record
        self._calibrated = False  # whether a good step has been seen
        self._run = 0  # consecutive skipped records
        self._active = False  # whether an episode is open (already reported)
        self._good = 0  # good records in a row inside an episode

    def update(self, record: StepRecord) -> list[Finding]:
        scale = finite(record.values, LOSS_SCALE)
        if scale is None:
            return []
        flag = finite(record.values, SKIPPED)
        prev, self._prev = self._prev, scale
        skipped = flag >= 0.5 if flag is not None else prev is not None and scale < prev
        known = flag is not None or prev is not None  # the first record alone cannot tell
        if not self._calibrated and known and not skipped:
            self._calibrated = True
            self._window.clear()  # the start-up fall is not a cascade
        self._run = self._run + 1 if skipped else 0
        self._window.append([record.step, scale, int(skipped)])
        if self._active:
            self._extend(skipped)
            return []
        if skipped and self._cascading(scale):
            return [self._open()]
        return []

    def _cascading(self, scale: float) -> bool:
        if scale <= self.floor:
            return True
        if not self._calibrated:
            return False
        top = max(s for _, s, _ in self._window)
        return self._run >= self.cascade or top >= self.drop * scale

    def _open(self) -> Finding:
        scales = [s for _, s, _ in self._window]
        skips = [step for step, _, flag in self._window if flag]
        start, end = skips[0], skips[-1]
        self._active, self._good = True, 0
        message = (
            f"fp16 overflow cascade: {len(skips)} skipped steps since step {start}, loss scale "
            f"{max(scales):g} -> {min(scales):g}: train in bf16 or run LayerNorm/softmax in fp32"
        )
        evidence = {"skips": len(skips), "scale_start": max(scales), "scale_min": min(scales)}
        remedies = ("upcast_to_fp32", "skip_step")
        return Finding("fp16_overflow", start, end, Severity.ERROR, message, evidence, (), remedies)

    def _extend(self, skipped: bool) -> None:
        self._good = 0 if skipped else self._good + 1
        if self._good >= self.quiet:
            self._active, self._good = False, 0
            self._window.clear()  # measure the next fall from the recovered scale

    def finish(self) -> list[Finding]:
        self._active, self._good = False, 0
        return []

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": [list(entry) for entry in self._window],
            "prev": self._prev,
            "calibrated": self._calibrated,
            "run": self._run,
            "active": self._active,
            "good": self._good,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._window.clear()
        self._window.extend([int(s), float(v), int(f)] for s, v, f in state["window"])
        self._prev = None if state["prev"] is None else float(state["prev"])
        self._calibrated, self._run = bool(state["calibrated"]), int(state["run"])
        self._active = bool(state["active"])
        self._good = int(state["good"])
