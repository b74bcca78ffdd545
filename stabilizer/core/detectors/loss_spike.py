"""`LossSpike`: the loss jumps and comes back (spike), or jumps and stays up (divergence)."""

from __future__ import annotations

from math import isfinite
from typing import Any, ClassVar

from stabilizer.core.records import Finding, Severity, StepRecord
from stabilizer.core.signals import LOSS

from ._robust import SpikeTracker
from .base import check_at_least

__all__ = ["LossSpike"]


class LossSpike:
    """Loss spikes that recover, and loss jumps that never come back (divergence).

    Requires: ``loss``.
    Rule: loss > med + k·max(σ, rel_floor·|med|) and loss ≥ min(min_ratio·med, med + min_jump).

    Here med and σ (MAD-based) are those of the last `window` finite losses before the spike.

    While a spike lasts the baseline is frozen, so the spike cannot raise its own bar. The episode
    ends when the loss is back under ``med + recover_k·max(σ, rel_floor·|med|)``: one
    ``loss_spike`` (WARNING), emitted then, because only its end tells a spike from a divergence.
    Still up after `recovery_window` steps, it is one ``divergence`` (ERROR), and the detector
    re-baselines on the new level. Non-finite losses are skipped (`NonFinite` reports them).

    Why these defaults, and not those of other tools:

    - Lightning's ``SpikeDetection`` flags loss ≥ 3× the mean of the last 10 losses. A mean is
      dragged up by the spike itself, and early in training, when the loss falls fast, ten steps
      span a large drop, so both the bar and the noise are wrong there. A median over 50 steps
      ignores up to 25 outliers and, on a falling curve, lies above the current loss: no false fire.
    - OLMo-core flags mean + 6σ over 128 steps. During the early fall σ measures the trend, not
      the noise, and inflates: a moderate spike (2.5 → 5) hides under it. MAD measures the noise.
    - k = 6 on a MAD σ: minibatch noise of ±5-10% never reaches 6σ, while 2.5 → 5 clears it. The
      floor ``rel_floor = 0.05`` keeps a near-constant loss (σ ≈ 0) from firing on a 1% wobble.
      The jump test (≥ 1.5× or ≥ +0.5 nats) keeps tiny, very smooth losses from firing on noise.

    Args:
        window: Number of recent finite losses in the baseline.
        min_history: Losses seen before any decision (warm-up; also after a divergence).
        k: Spike threshold in robust standard deviations.
        rel_floor: Lower bound of the standard deviation, relative to the median.
        min_ratio: A spike is at least this multiple of the baseline...
        min_jump: ...or at least this many nats above it (whichever is smaller).
        recover_k: Recovered when the loss is within this many standard deviations of the baseline.
        recovery_window: Steps a spike may last before it counts as a divergence.
    """

    name: ClassVar[str] = "loss_spike"
    requires: ClassVar[tuple[str, ...]] = (LOSS,)

    def __init__(
        self,
        window: int = 50,
        min_history: int = 20,
        k: float = 6.0,
        rel_floor: float = 0.05,
        min_ratio: float = 1.5,
        min_jump: float = 0.5,
        recover_k: float = 3.0,
        recovery_window: int = 100,
    ) -> None:
        self._tracker = SpikeTracker(window, min_history, recovery_window, self._classify)
        for arg, value in (("k", k), ("rel_floor", rel_floor), ("min_jump", min_jump)):
            check_at_least(arg, value, 0.0)
        check_at_least("min_ratio", min_ratio, 1.0)
        check_at_least("recover_k", recover_k, 0.0)
        if recover_k > k:
            raise ValueError(f"`recover_k` must be <= k ({k}), got {recover_k}")
        self.k, self.rel_floor, self.min_ratio, self.min_jump = k, rel_floor, min_ratio, min_jump
        self.recover_k, self.recovery_window = recover_k, recovery_window

    def _classify(self, loss: float, med: float, sigma: float) -> float | None:
        band = max(sigma, self.rel_floor * abs(med))
        jumped = loss >= med + self.min_jump or (med > 0 and loss >= self.min_ratio * med)
        return med + self.recover_k * band if loss > med + self.k * band and jumped else None

    def update(self, record: StepRecord) -> list[Finding]:
        loss = record.values.get(LOSS)
        if loss is None:
            return []
        ended = self._tracker.observe(record.step, loss) if isfinite(loss) else None
        if ended is None:
            return []
        outcome, episode = ended
        if outcome == "recovered":
            return [self._spike(episode, recovery_steps=record.step - episode["start"])]
        base, start = episode["baseline"], episode["start"]
        message = (
            f"loss diverged at step {start}: {loss:.4g} against a {base:.4g} baseline for over "
            f"{self.recovery_window} steps: roll back and lower the LR"
        )
        evidence = {"baseline": base, "peak": episode["peak"], "peak_step": episode["peak_step"]}
        evidence.update(level=loss, ratio=_ratio(loss, base))
        head = ("divergence", start, record.step, Severity.ERROR, message, evidence, ())
        return [Finding(*head, ("rollback", "scale_lr", "clip_gradients"))]

    def _spike(self, episode: dict[str, Any], recovery_steps: int | None) -> Finding:
        base, peak, peak_step = episode["baseline"], episode["peak"], episode["peak_step"]
        ratio, back = _ratio(peak, base), f"back after {recovery_steps} step"
        back += "s" if recovery_steps != 1 else ""
        message = (
            f"loss spiked from {base:.4g} to {peak:.4g} ({ratio:.1f}x) at step {peak_step}, "
            f"{back if recovery_steps is not None else 'still up at the end'}: "
            "clip gradients (norm 1.0)"
        )
        evidence = {"baseline": base, "peak": peak, "peak_step": peak_step, "ratio": ratio}
        evidence["recovered"] = float(recovery_steps is not None)
        if recovery_steps is not None:
            evidence["recovery_steps"] = recovery_steps
        start, end, remedies = episode["start"], episode["last"], ("clip_gradients", "rollback")
        return Finding("loss_spike", start, end, Severity.WARNING, message, evidence, (), remedies)

    def finish(self) -> list[Finding]:
        episode = self._tracker.close()
        return [] if episode is None else [self._spike(episode, recovery_steps=None)]

    def state_dict(self) -> dict[str, Any]:
        return self._tracker.state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._tracker.load(state)


def _ratio(value: float, baseline: float) -> float:
    return value / baseline if baseline > 0 else float("inf")
