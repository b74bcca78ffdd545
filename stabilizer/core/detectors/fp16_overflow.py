"""`Fp16Overflow`: the fp16 grad scaler skipping step after step, its scale collapsing."""

from __future__ import annotations

from collections import deque
from math import isfinite
from typing import Any, ClassVar

from stabilizer.core.kinds import FP16_OVERFLOW, kind_of
from stabilizer.core.records import Finding, Severity, StepRecord
from stabilizer.core.signals import LOSS_SCALE, SKIPPED

from .base import check_at_least

__all__ = ["Fp16Overflow"]

_FRESH = 2.0**15  # a fresh scaler halves from 65536 (torch, DeepSpeed) or 2^32: 32768 and up
_SETTLED = 16.0  # a fresh scaler's calibration never ends at or below this (see `_cascade`)


class Fp16Overflow:
    """An fp16 overflow cascade: the dynamic loss scaler cannot find a scale that works.

    Requires: ``loss_scale``; ``skipped`` (else a falling scale counts as a skipped step).
    Rule: a skip with ≥ `cascade` skips in a row, scale ÷ 2^`drop_pow` in `window`, or ≤ `floor`;
    before the first good step, ≥ `cascade` skips in a row from a fresh scale (2^14+) to ≤ 16.

    A scaler probes: it doubles its scale every N good steps and halves it on an overflow, skipping
    that step. An isolated skip with the scale holding is therefore healthy and stays silent. So
    does start-up: torch and DeepSpeed start at 65536 and halve step after step until the scale
    fits; skips before the first good step are that calibration, only the floor rule applies,
    unless the log's own steps say the run is past start-up (`startup` steps: from 2^32 a scaler
    halves to 1 in 32 steps) and no scale of a fresh scaler (2^15 or more) has been seen, as an
    excerpt shows that begins hundreds of steps in (a resumed run whose scaler starts afresh
    calibrates from 65536 again: that stays calibration), or they take a fresh scaler's scale
    down to 16 or below, where no calibration ends. The
    finding is emitted when the cascade is recognised (the run may never leave it); later skips
    extend the episode silently, and `quiet` good records in a row close it. An episode that
    grew after it was reported gets a closing finding with the same start and the final count:
    INFO when it closes, ERROR "until the end of the log" when the stream ends first. The finding
    starts at the cascade's first skip (that of the run of skips, or, for a fall of the scale, the
    first after its last top), so an earlier isolated skip in the window is not counted.

    Args:
        cascade: Consecutive skipped steps that make a cascade.
        drop_pow: A fall of the scale by 2**drop_pow within `window` records makes a cascade.
        window: Records over which the fall of the scale is measured.
        floor: A skipped step at a scale at or below this is a cascade (gradients overflow even
            unscaled).
        quiet: Good (unskipped) records in a row that end an episode.
        startup: From this step on, skips are no start-up calibration, good step seen or not.
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
        startup: int = 100,
    ) -> None:
        check_at_least("cascade", cascade, 2)
        check_at_least("drop_pow", drop_pow, 1)
        check_at_least("window", window, 2)
        check_at_least("floor", floor, 0.0)
        check_at_least("quiet", quiet, 1)
        check_at_least("startup", startup, 1)
        self.startup = startup
        self.cascade, self.drop, self.floor, self.quiet = cascade, 2.0**drop_pow, floor, quiet
        self._window: deque[tuple[int, float, int]] = deque(maxlen=window)  # step, scale, 0/1
        self._prev: float | None = None  # scale of the previous record
        self._calibrated = False  # whether a good step has been seen
        self._top = 0.0  # the highest scale seen
        self._run = 0  # consecutive skipped records
        self._active = False  # whether an episode is open (already reported)
        self._good = 0  # good records in a row inside an episode
        self._episode: dict[str, Any] = {}  # the open episode: steps, skips, scales

    def update(self, record: StepRecord) -> list[Finding]:
        values = record.values
        scale = values.get(LOSS_SCALE)
        if scale is None or not isfinite(scale):
            return []
        flag = values.get(SKIPPED)
        if flag is not None and not isfinite(flag):
            flag = None
        prev, self._prev = self._prev, scale
        self._top = max(self._top, scale)
        skipped = flag >= 0.5 if flag is not None else prev is not None and scale < prev
        known = flag is not None or prev is not None  # the first record alone cannot tell
        if not self._calibrated and known and not skipped:
            self._calibrated = True
            self._window.clear()  # the start-up fall is not a cascade
        elif not self._calibrated and record.step >= self.startup and self._top < _FRESH:
            self._calibrated = True  # past start-up, and no fresh scaler's scale in sight
        self._run = self._run + 1 if skipped else 0
        self._window.append((record.step, scale, int(skipped)))
        if self._active:
            return self._extend(record.step, scale, skipped)
        begin = self._cascade(scale) if skipped else None
        return [] if begin is None else [self._open(begin)]

    def _cascade(self, scale: float) -> int | None:
        """Where in the window the cascade begins (the record before its first skip, or the
        window's first record), when this skip makes one; else None.

        Before the first good step the skips are start-up calibration, unless they take a fresh
        scaler's scale (an overflow line names it halved: 16384 and up) down to `_SETTLED` or
        below: calibration finds a scale where gradients fit fp16 long before that (stylegan2-
        pytorch#100: apex halving from 16384 to 2, skip after skip)."""
        window = self._window
        if scale <= self.floor or (self._calibrated and self._run >= self.cascade):
            return max(len(window) - self._run - 1, 0)  # the run of skips ending here
        if not self._calibrated:
            past = scale <= _SETTLED and self._top >= _FRESH / 2 and self._run >= self.cascade
            return max(len(window) - self._run - 1, 0) if past else None
        scales = [s for _, s, _ in window]
        top = max(scales)
        if top < self.drop * scale:
            return None
        return len(scales) - 1 - scales[::-1].index(top)  # the fall from the last top

    def _open(self, begin: int) -> Finding:
        entries = list(self._window)[begin:]
        scales = [s for _, s, _ in entries]
        skips = [step for step, _, flag in entries if flag]
        self._active, self._good = True, 0
        self._episode = {"start": skips[0], "last": skips[-1], "skips": len(skips)}
        self._episode.update(scale_start=max(scales), scale_min=min(scales), reported=len(skips))
        return self._finding(Severity.ERROR, "")

    def _finding(self, severity: Severity, outcome: str) -> Finding:
        episode = self._episode
        start, count = episode["start"], episode["skips"]
        since = f"{count} skipped steps since step" if count > 1 else "1 skipped step at step"
        top, low = episode["scale_start"], episode["scale_min"]
        scale = f"loss scale {top:g} -> {low:g}"  # (a scale that never moved: where it stays)
        if top == low:
            scale = f"loss scale stuck at {low:g}" if count > 1 else f"at loss scale {low:g}"
        return Finding(
            kind=FP16_OVERFLOW,
            step=start,
            end_step=episode["last"],
            severity=severity,
            seen=f"fp16 overflow cascade: {since} {start}, {scale}{outcome}",
            evidence={"skips": count, "scale_start": top, "scale_min": low},
            remedies=kind_of(FP16_OVERFLOW).remedies,
            advice="" if outcome else "train in bf16 or run LayerNorm/softmax in fp32",
        )

    def _extend(self, step: int, scale: float, skipped: bool) -> list[Finding]:
        """A record inside an open episode: a skip extends it, `quiet` good records close it."""
        episode = self._episode
        episode["scale_min"] = min(episode["scale_min"], scale)
        if skipped:
            episode["last"], episode["skips"] = step, episode["skips"] + 1
        self._good = 0 if skipped else self._good + 1
        if self._good < self.quiet:
            return []
        self._active, self._good = False, 0
        self._window.clear()  # measure the next fall from the recovered scale
        if episode["skips"] == episode["reported"]:
            return []
        outcome = f"; over, the scale holds at {scale:g} since step {episode['last'] + 1}"
        return [self._finding(Severity.INFO, outcome)]

    def finish(self) -> list[Finding]:
        grew = self._active and self._episode["skips"] > self._episode["reported"]
        found = [self._finding(Severity.ERROR, ", until the end of the log")] if grew else []
        self._active, self._good = False, 0
        return found

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": [list(entry) for entry in self._window],
            "prev": self._prev,
            "calibrated": self._calibrated,
            "top": self._top,
            "run": self._run,
            "active": self._active,
            "good": self._good,
            "episode": dict(self._episode),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._window.clear()
        self._window.extend((int(s), float(v), int(f)) for s, v, f in state["window"])
        self._prev = None if state["prev"] is None else float(state["prev"])
        self._calibrated, self._run = bool(state["calibrated"]), int(state["run"])
        self._top = float(state.get("top", 0.0))
        self._active = bool(state["active"])
        self._good = int(state["good"])
        self._episode = dict(state.get("episode", {}))
