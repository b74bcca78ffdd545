"""`GradSpike`: outliers of the pre-clip gradient norm, and clipping that fires on most steps."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from stabilizer.core.records import Finding, Severity, StepRecord
from stabilizer.core.signals import CLIP_VAL, CLIPPED, GRAD_NORM

from ._clipping import ClipWindow
from ._robust import SpikeTracker, exp10
from .base import check_at_least, check_fraction

__all__ = ["GradSpike"]


class GradSpike:
    """Gradient-norm spikes (one outsized batch), and clipping saturation (the LR is too high).

    Requires: ``grad_norm`` (total, unscaled, before clipping); ``clipped`` or ``clip_val``.
    Rule: log10(norm) > med + k·max(σ, sigma_floor) and norm ≥ min_ratio·10^med; clipped > half.

    Gradient norms are roughly log-normal, so the baseline lives in log10 space: median and MAD of
    the last `window` positive finite norms, frozen while a spike lasts. A spike is one
    ``grad_spike`` (WARNING) emitted when the norm is back under ``med + recover_k·σ``; still up
    after `recovery_window` steps, it is reported as a level shift and the baseline restarts.
    Defaults: typical step-to-step noise is 10-30% (σ ≈ 0.05-0.1 decades), so 5σ with a 3× floor
    ignores it and catches the 10-100× outliers that precede loss spikes.

    When ``clipped`` is logged (or derivable as ``grad_norm > clip_val``), more than half of the
    last `clip_window` steps clipped means clipping has become the optimizer's step-size control:
    one ``clip_saturation`` (WARNING) at onset, re-armed when the fraction falls under half of
    `clip_fraction` (Google's tuning playbook: lower the LR instead).

    Args:
        window: Number of recent norms in the baseline.
        min_history: Norms seen before any decision (warm-up; also after a level shift).
        k: Spike threshold in robust standard deviations of log10(norm).
        sigma_floor: Lower bound of that standard deviation, in decades.
        min_ratio: A spike is at least this multiple of the baseline norm.
        recover_k: Recovered when within this many standard deviations of the baseline.
        recovery_window: Steps a spike may last before it counts as a level shift.
        clip_window: Steps over which the clipped fraction is measured.
        clip_fraction: Clipped fraction above which clipping counts as saturated.
    """

    name: ClassVar[str] = "grad_spike"
    requires: ClassVar[tuple[str, ...]] = (GRAD_NORM, CLIPPED)

    def __init__(
        self,
        window: int = 100,
        min_history: int = 20,
        k: float = 5.0,
        sigma_floor: float = 0.05,
        min_ratio: float = 3.0,
        recover_k: float = 2.5,
        recovery_window: int = 100,
        clip_window: int = 100,
        clip_fraction: float = 0.5,
    ) -> None:
        self._tracker = SpikeTracker(window, min_history, recovery_window, self._classify)
        for arg, value, low in (("k", k, 0.0), ("sigma_floor", sigma_floor, 0.0)):
            check_at_least(arg, value, low)
        check_at_least("min_ratio", min_ratio, 1.0)
        check_at_least("recover_k", recover_k, 0.0)
        check_at_least("clip_window", clip_window, 1)
        check_fraction("clip_fraction", clip_fraction)
        self.k, self.sigma_floor, self.min_jump = k, sigma_floor, math.log10(min_ratio)
        self.recover_k, self.recovery_window = recover_k, recovery_window
        self.clip_window, self.clip_fraction = clip_window, clip_fraction
        self._clips = ClipWindow(clip_window, clip_fraction)

    def _classify(self, x: float, med: float, sigma: float) -> float | None:
        band = max(sigma, self.sigma_floor)
        spike = x > med + self.k * band and x >= med + self.min_jump
        return med + self.recover_k * band if spike else None

    def update(self, record: StepRecord) -> list[Finding]:
        values = record.values
        clips = CLIPPED in values or CLIP_VAL in values
        findings = self._clips.update(record.step, values) if clips else []
        norm = values.get(GRAD_NORM)
        if norm is None or not 0.0 < norm < math.inf:
            return findings
        ended = self._tracker.observe(record.step, math.log10(norm))
        if ended is not None:
            lasting = f"still up after {self.recovery_window} steps"
            recovered = ended[0] == "recovered"
            findings.append(self._spike(ended[1], "back to normal" if recovered else lasting))
        return findings

    def _spike(self, episode: dict[str, Any], outcome: str) -> Finding:
        base, peak = exp10(episode["baseline"]), exp10(episode["peak"])
        ratio, peak_step = peak / base, episode["peak_step"]
        message = (
            f"gradient norm spiked to {peak:.3g} ({ratio:.0f}x the {base:.3g} baseline) at step "
            f"{peak_step}, {outcome}: clip the gradient norm near its usual level"
        )
        evidence = {"baseline": base, "peak": peak, "ratio": ratio, "peak_step": peak_step}
        evidence["steps"] = episode["last"] - episode["start"] + 1
        start, end, remedies = episode["start"], episode["last"], ("clip_gradients", "skip_step")
        return Finding("grad_spike", start, end, Severity.WARNING, message, evidence, (), remedies)

    def finish(self) -> list[Finding]:
        episode = self._tracker.close()
        return [] if episode is None else [self._spike(episode, "still up at the end")]

    def state_dict(self) -> dict[str, Any]:
        return {**self._tracker.state(), **self._clips.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._tracker.load(state)
        self._clips.load(state)
