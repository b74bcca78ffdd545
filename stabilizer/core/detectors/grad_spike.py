"""`GradSpike`: outliers of the pre-clip gradient norm, and clipping that fires on most steps."""

from __future__ import annotations

import math
from itertools import pairwise
from typing import Any, ClassVar

from stabilizer.core.kinds import GRAD_SPIKE, kind_of
from stabilizer.core.records import Finding, Severity, StepRecord
from stabilizer.core.signals import CLIP_VAL, CLIPPED, GRAD_NORM, LOSS

from ._clipping import ClipWindow
from ._level import new_level
from ._regime import Regime
from ._robust import RobustWindow, SpikeTracker, exp10
from .base import check_at_least, check_fraction

__all__ = ["GradSpike"]

_KEEP = 64  # losses of an open episode kept (to tell a bump that went with a new level)


class GradSpike:
    """Gradient-norm spikes (one outsized batch, or a norm growing geometrically), and clipping
    that fires on most steps (the LR is too high).

    Requires: ``grad_norm`` (total, unscaled, before clipping); ``clipped`` or ``clip_val``.
    Rule: log10(norm) > med + k·max(σ, sigma_floor), and norm ≥ min_ratio·10^med and ≥
    tail_ratio× the largest bump of the last `memory` records once `min_history` norms are in the
    baseline, ≥ short_ratio·10^med before (from the third norm on), or `growth`× each of the last
    `grow_records` records (or `slow_growth`× each of the last `slow_records`, `slow_total`× in
    all); clipped on more than half the steps.

    Gradient norms are roughly log-normal, so the baseline lives in log10 space: median and MAD of
    the last `window` positive finite norms, frozen while a spike lasts. The baseline rests on what
    is there (``baseline_records`` in the evidence), so a pasted excerpt is judged from its third
    record on; on so few records the norm must reach 10× their median, and after a single record
    1000× it (three orders of magnitude: no batch noise does that). A norm that doubles record
    after record is an explosion under way whatever its ratio to the median (BLOOM-176B:
    0.24 → 0.95 → 2.39 → 15.9), and so is one growing 15% or more record after record for six
    records, tenfold in all, while no record jumps (grokfast#9: ×1.5 a record, the loss flat at
    11.3). A spike is one ``grad_spike`` (WARNING) emitted when the norm is
    back under ``med + recover_k·σ``, or at the end of the log; still up after `recovery_window`
    steps, it is reported as a level shift and the baseline restarts. Defaults: typical
    step-to-step noise is 10-30% (σ ≈ 0.05-0.1 decades), so 5σ with a 3× floor ignores it and
    catches the 10-100× outliers that precede loss spikes; large norms at the start of training
    fall, and a fall is never a spike.

    A spike must be outsized for *this* run, not for a fixed multiple: real norms have a heavy
    tail that a MAD does not see (llm.c's GPT-2 124M run: the norm within 5% of its median, and
    yet a 3x, a 5x and a 7.5x one-step bump in 20,000 steps, the loss unmoved). So in a long log a
    spike that came back is reported only if it is also `tail_ratio`× the largest bump (a rise
    over the baseline median) of the `memory` records before it, spikes among them; a smaller
    one is the run's regime, folded into the spike reported last (`Regime`: one update at the
    end says how many): a run whose norm keeps bumping 3-6x gets one episode, not one per bump.

    When ``clipped`` is logged (or derivable as ``grad_norm > clip_val``), more than half of the
    last `clip_window` steps clipped means clipping has become the optimizer's step-size control:
    one ``clip_saturation`` (WARNING) at onset, re-armed when the fraction falls under half of
    `clip_fraction` (Google's tuning playbook: lower the LR instead).

    Args:
        window: Number of recent norms in the baseline.
        min_history: Norms in the baseline from which the long-log rule applies.
        k: Spike threshold in robust standard deviations of log10(norm).
        sigma_floor: Lower bound of that standard deviation, in decades.
        min_ratio: Long logs: a spike is at least this multiple of the baseline norm.
        short_ratio: Short excerpts: a spike is at least this multiple of the baseline norm.
        lone_ratio: Right after a single record: a spike is at least this multiple of it.
        growth: Growth factor per record that counts as geometric growth...
        grow_records: ...over this many records in a row.
        slow_growth: A slower growth factor per record that counts too...
        slow_records: ...over this many records in a row...
        slow_total: ...when they grow this many times over in all.
        recover_k: Recovered when within this many standard deviations of the baseline.
        recovery_window: Steps a spike may last before it counts as a level shift.
        tail_ratio: Long logs: a spike is at least this multiple of the run's largest recent bump...
        memory: ...over this many records.
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
        short_ratio: float = 10.0,
        lone_ratio: float = 1000.0,
        growth: float = 2.0,
        grow_records: int = 3,
        slow_growth: float = 1.15,
        slow_records: int = 6,
        slow_total: float = 10.0,
        recover_k: float = 2.5,
        recovery_window: int = 100,
        tail_ratio: float = 2.0,
        memory: int = 2000,
        clip_window: int = 100,
        clip_fraction: float = 0.5,
    ) -> None:
        self._tracker = SpikeTracker(window, self._classify)
        check_at_least("min_history", min_history, 2)
        if min_history > window:
            raise ValueError(f"`min_history` must be <= window ({window}), got {min_history}")
        for arg, value, low in (("k", k, 0.0), ("sigma_floor", sigma_floor, 0.0)):
            check_at_least(arg, value, low)
        for arg, value in (
            ("min_ratio", min_ratio),
            ("short_ratio", short_ratio),
            ("lone_ratio", lone_ratio),
            ("tail_ratio", tail_ratio),
        ):
            check_at_least(arg, value, 1.0)
        for arg, value in (("growth", growth), ("slow_growth", slow_growth)):
            check_at_least(arg, value, 1.0)
        check_at_least("slow_total", slow_total, 1.0)
        for arg, count in (("grow_records", grow_records), ("slow_records", slow_records)):
            check_at_least(arg, count, 1)
            if count >= window:
                raise ValueError(f"`{arg}` must be < window ({window}), got {count}")
        check_at_least("recover_k", recover_k, 0.0)
        check_at_least("recovery_window", recovery_window, 1)
        check_at_least("memory", memory, 1)
        check_at_least("clip_window", clip_window, 1)
        check_fraction("clip_fraction", clip_fraction)
        self.min_history, self.k, self.sigma_floor = min_history, k, sigma_floor
        self.min_jump, self.short_jump = math.log10(min_ratio), math.log10(short_ratio)
        self.lone_jump = math.log10(lone_ratio)
        self.growth, self.grow_records = math.log10(growth), grow_records
        self.slow_growth, self.slow_records = math.log10(slow_growth), slow_records
        self.slow_total = math.log10(slow_total)
        self.recover_k, self.recovery_window = recover_k, recovery_window
        self.tail_jump = math.log10(tail_ratio)
        self.clip_window, self.clip_fraction = clip_window, clip_fraction
        self._clips = ClipWindow(clip_window, clip_fraction)
        self._regime = Regime(memory)  # the run's recent rises over its median, in decades
        self._rise = 0.0  # the rise of the norm `_classify` saw last
        self._loss = 0.0  # the last finite loss outside an episode

    def _classify(self, x: float, window: RobustWindow) -> tuple[float, float] | None:
        count = len(window.values)  # (the deque's own len: one Python call less a norm)
        if count < 2:
            lone = window.values[0] if count else math.inf
            if x - lone < self.lone_jump:
                return None
            return lone, lone + self.recover_k * self.sigma_floor
        med = window.median()
        self._rise = x - med
        jump = self.min_jump if count >= self.min_history else self.short_jump
        if x > med and self._growing(x, window):
            # Growth is its own evidence, and the spread of the norms before is its trend.
            return med, med + self.recover_k * self.sigma_floor
        if x < med + jump:
            return None  # most norms: no jump, so no need to measure the noise
        band = max(window.sigma(med), self.sigma_floor)
        return (med, med + self.recover_k * band) if x > med + self.k * band else None

    def _growing(self, x: float, window: RobustWindow) -> bool:
        """Whether ``x`` ends `grow_records` records in a row, each `growth`× the one before,
        or `slow_records` records each `slow_growth`× the one before and `slow_total`× in all."""
        values = window.values
        if x - values[-1] < self.slow_growth:
            return False  # most norms
        if len(values) >= self.grow_records and x - values[-1] >= self.growth:
            run = [values[i] for i in range(-self.grow_records, 0)] + [x]
            if all(b - a >= self.growth for a, b in pairwise(run)):
                return True
        if len(values) < self.slow_records or x - values[-self.slow_records] < self.slow_total:
            return False
        run = [values[i] for i in range(-self.slow_records, 0)] + [x]
        return all(b - a >= self.slow_growth for a, b in pairwise(run))

    def update(self, record: StepRecord) -> list[Finding]:
        values = record.values
        clips = CLIPPED in values or CLIP_VAL in values
        findings = self._clips.update(record.step, values) if clips else []
        norm = values.get(GRAD_NORM)
        if norm is None or not 0.0 < norm < math.inf:
            return findings
        level, tracker, regime = math.log10(norm), self._tracker, self._regime
        opened = tracker.episode
        self._rise = 0.0
        ended = tracker.observe(record.step, level)
        episode = tracker.episode
        loss = values.get(LOSS)
        if episode is None:
            if loss is not None and math.isfinite(loss):
                self._loss = loss  # (the loss before a bump: `_with_new_level`)
        else:
            self._follow_loss(episode, opened is None, loss)
        if episode is not None and opened is None:
            episode["tail"] = regime.bumps.largest()  # the run's bumps before this one
        # Every record's rise joins the run's bumps: over its median, or in a spike over the
        # baseline the spike froze (the spikes are bumps the run has shown too).
        regime.bumps.rises.append(  # (`Bumps.push`, without its call: every record)
            level - opened["baseline"] if opened is not None else self._rise
        )
        if ended is not None:
            findings += self._ended(ended)
        if episode is not None and record.step - episode["start"] > self.recovery_window:
            tracker.rebaseline([level])  # a lasting shift: re-baseline on the new level
            regime.new()
            if not _with_new_level(episode):
                outcome = f"still up after {self.recovery_window} steps"
                findings.append(self._spike(episode, outcome))
        return findings

    def _follow_loss(self, episode: dict[str, Any], fresh: bool, loss: float | None) -> None:
        """Keep the losses of an open episode, and the one before it, to tell a bump that went
        with a new level of the loss (`_with_new_level`)."""
        if fresh:
            episode["loss_before"], episode["losses"] = self._loss, []
        if loss is not None and math.isfinite(loss):
            episode["losses"] = [*episode["losses"][-(_KEEP - 1) :], loss]

    def _ended(self, episode: dict[str, Any]) -> list[Finding]:
        """A spike that came back: reported if outsized for this run, else folded (`Regime`);
        none where it went with a new level of the loss (`_with_new_level`)."""
        if _with_new_level(episode):
            return []
        rise = episode["peak"] - episode["baseline"]
        if (
            episode["baseline_records"] >= self.min_history
            and rise < episode.get("tail", 0.0) + self.tail_jump
        ):
            self._regime.fold(episode["last"])
            return []
        return [self._regime.report(self._spike(episode, "back to normal"))]

    def _spike(self, episode: dict[str, Any], outcome: str) -> Finding:
        base, peak = exp10(episode["baseline"]), exp10(episode["peak"])
        ratio, peak_step, records = peak / base, episode["peak_step"], episode["baseline_records"]
        evidence = {"baseline": base, "baseline_records": records, "peak": peak, "ratio": ratio}
        evidence.update(peak_step=peak_step, steps=episode["last"] - episode["start"] + 1)
        return Finding(
            kind=GRAD_SPIKE,
            step=episode["start"],
            end_step=episode["last"],
            severity=Severity.WARNING,
            seen=f"gradient norm spiked to {peak:.3g} ({_times(ratio)} "
            f"{_before(base, records)}) at step {peak_step}, {outcome}",
            evidence=evidence,
            remedies=kind_of(GRAD_SPIKE).remedies,
            advice="clip the gradient norm near its usual level",
        )

    def finish(self) -> list[Finding]:
        episode = self._tracker.close()
        found = [] if episode is None else [self._spike(episode, "up until the end of the log")]
        folded = self._regime.close()
        return found if folded is None else [folded, *found]

    def restart(self) -> None:
        """Training restarted from earlier weights: its baseline starts over (`Engine.restart`)."""
        self._tracker.restart()

    def state_dict(self) -> dict[str, Any]:
        return {**self._tracker.state(), **self._clips.state(), "regime": self._regime.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._tracker.load(state)
        self._clips.load(state)
        self._regime.load(state.get("regime"))  # absent in checkpoints of earlier rounds


def _with_new_level(episode: dict[str, Any]) -> bool:
    """Whether a gradient-norm episode went with a new level of the loss (`_level.new_level`)."""
    return new_level(float(episode.get("loss_before", 0.0)), episode.get("losses", []))


def _times(ratio: float) -> str:
    """``"11x"``; past a million, in three digits (``"3.2e+20x"``, never 21 of them)."""
    return f"{ratio:.0f}x" if ratio < 1e6 else f"{ratio:.3g}x"


def _before(base: float, records: int) -> str:
    """What a spike is measured against: the median of the records before, or the one record."""
    if records == 1:
        return f"the {base:.3g} of the record before"
    return f"the {base:.3g} median of {records} records before"
