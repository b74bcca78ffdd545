"""`LossSpike`: the loss jumps and comes back (spike), or jumps and stays up (divergence)."""

from __future__ import annotations

from itertools import pairwise
from math import isfinite
from typing import Any, ClassVar

from stabilizer.core.kinds import DIVERGENCE, LOSS_SPIKE, kind_of
from stabilizer.core.records import Finding, Severity, StepRecord
from stabilizer.core.signals import LOSS

from ._robust import RobustWindow, SpikeTracker
from .base import check_at_least

__all__ = ["LossSpike"]

_HOLD = 0.5  # a loss that keeps this share of its recent excess is not falling back


class LossSpike:
    """Loss spikes that recover, and loss jumps that stay up (divergence).

    Requires: ``loss``.
    Rule: loss > med + k·max(σ, rel_floor·|med|), and ≥ min(min_ratio·med, med + min_jump) once
    `min_history` losses are in the baseline, ≥ short_ratio·med before (from the third loss on).

    Here med and σ (MAD-based) are those of the last `window` finite losses before the spike:
    the baseline rests on what is there, so a pasted excerpt of a few records is judged from its
    second record on (the evidence says how many records: ``baseline_records``). On so few, σ says
    little, so the jump must be larger (a doubling) and stand out of the stretch's own spread; a
    loss that has been falling (a warm-up: 12, 9, 4, 2.6, 1.9) is measured against the level it
    has reached (1.9), not the median of its fall. After a single record a jump counts only if it
    stays up: every loss after it at least `short_ratio` times that record, for `settle_records`
    records; the loss at step 0 (before any update) is no baseline on its own.

    While a spike lasts the baseline is frozen, so the spike cannot raise its own bar. The episode
    ends when the loss is back under ``med + recover_k·max(σ, rel_floor·|med|)``: one
    ``loss_spike`` (WARNING), emitted then, because only its end tells a spike from a divergence.
    Still up after `settle_steps` steps and `settle_records` records, and not falling back (the
    loss keeps half its largest excess of those records), it is a ``divergence`` (ERROR), emitted
    at once (a live monitor rolls back on it); the episode then runs on, and a
    second ``divergence`` finding with the same start closes it: INFO where the loss is back under
    the bar, ERROR "until the end of the log" when the stream ends first. Non-finite losses are
    skipped (`NonFinite` reports them).

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
    - 20 steps and 3 records to call a divergence: a spike from one bad batch is back within a
      few steps; the loss of a run thrown into a worse region stays up. Calling it late costs the
      rollback what the run learns meanwhile.

    Args:
        window: Number of recent finite losses in the baseline.
        min_history: Losses in the baseline from which the long-log rule applies.
        k: Spike threshold in robust standard deviations.
        rel_floor: Lower bound of the standard deviation, relative to the median.
        min_ratio: Long logs: a spike is at least this multiple of the baseline...
        min_jump: ...or at least this many nats above it (whichever is smaller).
        short_ratio: Short excerpts: a spike is at least this multiple of the baseline.
        recover_k: Recovered when the loss is within this many standard deviations of the baseline.
        settle_steps: Steps a spike may last before it counts as a divergence...
        settle_records: ...and records (for logs that print every N steps).
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
        short_ratio: float = 2.0,
        recover_k: float = 3.0,
        settle_steps: int = 20,
        settle_records: int = 3,
    ) -> None:
        self._tracker = SpikeTracker(window, self._classify)
        check_at_least("min_history", min_history, 2)
        if min_history > window:
            raise ValueError(f"`min_history` must be <= window ({window}), got {min_history}")
        for arg, value in (("k", k), ("rel_floor", rel_floor), ("min_jump", min_jump)):
            check_at_least(arg, value, 0.0)
        check_at_least("min_ratio", min_ratio, 1.0)
        check_at_least("short_ratio", short_ratio, 1.0)
        check_at_least("recover_k", recover_k, 0.0)
        if recover_k > k:
            raise ValueError(f"`recover_k` must be <= k ({k}), got {recover_k}")
        check_at_least("settle_steps", settle_steps, 1)
        check_at_least("settle_records", settle_records, 2)
        self.min_history, self.k, self.rel_floor = min_history, k, rel_floor
        self.min_ratio, self.min_jump, self.short_ratio = min_ratio, min_jump, short_ratio
        self.recover_k = recover_k
        self.settle_steps, self.settle_records = settle_steps, settle_records
        self._zero = False  # whether the first loss of the baseline is that of step 0

    def _classify(self, loss: float, window: RobustWindow) -> tuple[float, float] | None:
        count = len(window.values)  # (the deque's own len: one Python call less a loss)
        if count < self.min_history:
            return self._short(loss, window) if count else None
        med = window.median()
        if not (loss >= med + self.min_jump or (med > 0 and loss >= self.min_ratio * med)):
            return None  # most losses: no jump, so no need to measure the noise
        band = max(window.sigma(med), self.rel_floor * abs(med))
        return (med, med + self.recover_k * band) if loss > med + self.k * band else None

    def _short(self, loss: float, window: RobustWindow) -> tuple[float, float] | None:
        """`_classify` on a short excerpt: against the level a falling loss has reached (its
        last value), else the median; a doubling that stands out of the stretch's spread."""
        values = window.values
        falling = all(b <= a for a, b in pairwise(values))
        med = values[-1] if falling else window.median()
        if loss < med + (self.short_ratio - 1.0) * abs(med):
            return None
        band = self.rel_floor * abs(med)
        if not falling:
            band = max(window.sigma(med), band)
        return (med, med + self.recover_k * band) if loss > med + self.k * band else None

    def update(self, record: StepRecord) -> list[Finding]:
        loss = record.values.get(LOSS)
        if loss is None or not isfinite(loss):
            return []
        tracker = self._tracker
        if not tracker.window.values and tracker.episode is None:
            self._zero = record.step == 0  # (a first record at step 0: see `_alone`)
        ended = tracker.observe(record.step, loss)
        if ended is not None:
            back = record.step - ended["start"]
            if "called" in ended:
                return [self._back(ended, back)]
            return [] if ended["baseline_records"] < 2 else [self._spike(ended, back)]
        episode = tracker.episode
        if episode is None:
            return []
        if episode["baseline_records"] < 2 and self._alone(loss, episode["baseline"]):
            tracker.episode = None
            tracker.window.push(loss)
            return []
        episode["level"] = loss
        # A new list, not an append: `state` copies the episode shallowly.
        episode["recent"] = [*episode.get("recent", [])[1 - self.settle_records :], loss]
        if "called" in episode or not self._settled(episode):
            return []
        episode["called"] = record.step
        return [self._divergence(episode, end_of_log=False)]

    def _alone(self, loss: float, baseline: float) -> bool:
        """Whether a loss after a single record says nothing: it is back under `short_ratio`
        times that record (a jump must stay up), or that record is the loss at step 0, before
        any update (spaCy then sums the losses of 200 steps)."""
        return self._zero or loss < self.short_ratio * baseline

    def _settled(self, episode: dict[str, Any]) -> bool:
        """Whether the loss has stayed up long enough, and is not on its way back down.

        A spike that decays over several records (5.7, 4.7, 3.8, 3.0 on a 2.05 baseline) is not
        a divergence: the loss must hold at least `_HOLD` of its largest excess over the baseline
        in the last `settle_records` records.
        """
        if episode["last"] - episode["start"] < self.settle_steps:
            return False
        if episode["records"] < self.settle_records:
            return False
        base: float = episode["baseline"]
        recent: list[float] = episode["recent"]
        return recent[-1] - base >= _HOLD * (max(recent) - base)

    def _spike(self, episode: dict[str, Any], back: int | None) -> Finding:
        base, peak, peak_step = episode["baseline"], episode["peak"], episode["peak_step"]
        ratio = _ratio(peak, base)
        how = "up until the end of the log" if back is None else f"back after {_steps(back)}"
        evidence = _evidence(episode)
        evidence["recovered"] = float(back is not None)
        if back is not None:
            evidence["recovery_steps"] = back
        return Finding(
            kind=LOSS_SPIKE,
            step=episode["start"],
            end_step=episode["last"],
            severity=Severity.WARNING,
            seen=f"loss spiked from {base:.4g} to {peak:.4g} ({ratio:.1f}x) at step {peak_step}, "
            f"{how}",
            evidence=evidence,
            remedies=kind_of(LOSS_SPIKE).remedies,
            advice="clip gradients (norm 1.0)",
        )

    def _divergence(self, episode: dict[str, Any], end_of_log: bool) -> Finding:
        base, start, level = episode["baseline"], episode["start"], episode["level"]
        if end_of_log:
            span = "and stayed up until the end of the log"
        else:
            span = f"for {_steps(episode['last'] - start)} ({episode['records']} records)"
        return Finding(
            kind=DIVERGENCE,
            step=start,
            end_step=episode["last"],
            severity=Severity.ERROR,
            seen=f"loss diverged at step {start}: {level:.4g} against a {base:.4g} baseline {span}",
            evidence=_evidence(episode),
            remedies=kind_of(DIVERGENCE).remedies,
            advice="roll back and lower the LR",
        )

    def _back(self, episode: dict[str, Any], back: int) -> Finding:
        start = episode["start"]
        return Finding(
            kind=DIVERGENCE,
            step=start,
            end_step=episode["last"],
            severity=Severity.INFO,
            seen=f"loss back under its {episode['baseline']:.4g} baseline's band "
            f"{_steps(back)} after it diverged at step {start}",
            evidence={**_evidence(episode), "recovery_steps": float(back)},
        )

    def finish(self) -> list[Finding]:
        episode = self._tracker.close()
        if episode is None:
            return []
        if "called" in episode:
            return [self._divergence(episode, end_of_log=True)]
        if episode["baseline_records"] < 2 and episode["records"] < self.settle_records:
            return []  # after a single record, only a jump that stays up says something
        return [self._spike(episode, back=None)]

    def restart(self) -> None:
        """Training restarted from earlier weights: its baseline starts over (`Engine.restart`)."""
        self._tracker.restart()

    def state_dict(self) -> dict[str, Any]:
        return {**self._tracker.state(), "zero": self._zero}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._zero = bool(state.get("zero", False))  # absent in checkpoints of earlier rounds
        self._tracker.load({k: v for k, v in state.items() if k != "zero"})


def _evidence(episode: dict[str, Any]) -> dict[str, float]:
    base, peak = episode["baseline"], episode["peak"]
    evidence = {"baseline": base, "baseline_records": episode["baseline_records"], "peak": peak}
    evidence.update(peak_step=episode["peak_step"], ratio=_ratio(peak, base))
    if "level" in episode:
        evidence["level"] = episode["level"]
    return evidence


def _steps(count: int) -> str:
    return f"{count} step" if count == 1 else f"{count} steps"


def _ratio(value: float, baseline: float) -> float:
    return value / baseline if baseline > 0 else float("inf")
