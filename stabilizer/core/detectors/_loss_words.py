"""The findings `LossSpike` reports, worded as a person reading the log would say them."""

from __future__ import annotations

from typing import Any

from stabilizer.core.kinds import DIVERGENCE, LOSS_SPIKE, kind_of
from stabilizer.core.records import Finding, Severity
from stabilizer.core.remedies import CLIP_GRADIENTS, SCALE_LR

__all__ = ["back", "divergence", "never_learned", "spike"]

_LOST = (SCALE_LR, CLIP_GRADIENTS)  # a run that sat far above its start: its LR, not a batch


def spike(episode: dict[str, Any], back_after: int | None) -> Finding:
    """A spike that came back after ``back_after`` steps (None: up until the end of the log)."""
    base, peak, peak_step = episode["baseline"], episode["peak"], episode["peak_step"]
    how = "up until the end of the log" if back_after is None else f"back after {steps(back_after)}"
    evidence = _evidence(episode)
    evidence["recovered"] = float(back_after is not None)
    if back_after is not None:
        evidence["recovery_steps"] = back_after
    return Finding(
        kind=LOSS_SPIKE,
        step=episode["start"],
        end_step=episode["last"],
        severity=Severity.WARNING,
        seen=f"loss spiked from {base:.4g} to {peak:.4g} ({_ratio_text(peak, base)}) at step "
        f"{peak_step}, {how}",
        evidence=evidence,
        remedies=kind_of(LOSS_SPIKE).remedies,
        advice="clip gradients (norm 1.0)",
    )


def divergence(episode: dict[str, Any], end_of_log: bool, start_of_run: bool) -> Finding:
    """A divergence: called while it lasts, or still up at the end of the log."""
    base, start, level = episode["baseline"], episode["start"], episode["level"]
    against = f"its {base:.4g} start" if start_of_run else f"a {base:.4g} baseline"
    if end_of_log:
        span = "and stayed up until the end of the log"
        if start_of_run:
            span = "and never got back to where it started"
    else:
        span = f"for {steps(episode['last'] - start)} ({episode['records']} records)"
    return Finding(
        kind=DIVERGENCE,
        step=start,
        end_step=episode["last"],
        severity=Severity.ERROR,
        seen=f"loss diverged at step {start}: {level:.4g} against {against} {span}",
        evidence=_evidence(episode),
        remedies=kind_of(DIVERGENCE).remedies,
        advice="roll back and lower the LR",
    )


def back(episode: dict[str, Any], back_step: int, lost: bool) -> Finding:
    """A divergence whose loss came back under its baseline's band at ``back_step``; ``lost``:
    it sat up there for most of the log's records, and the run lost what it trained for then.

    INFO either way: the episode is an ERROR already (its call), and a live ``auto`` policy must
    not roll back because the loss came back; what it says is the outcome."""
    base, start, records = episode["baseline"], episode["start"], episode["records"]
    back_after = back_step - start
    evidence = {**_evidence(episode), "recovery_steps": float(back_after)}
    peak = episode["peak"]
    diverged = f"loss diverged at step {start} ({peak:.4g} against a {base:.4g} baseline)"
    seen = f"{diverged} and came back under its band {steps(back_after)} later"
    remedies: tuple[str, ...] = ()
    if lost:
        seen = (
            f"{diverged} and sat far above it for {records} records, most of the log, until "
            f"step {back_step}: most of the run was lost"
        )
        remedies = _LOST
    return Finding(
        kind=DIVERGENCE,
        step=start,
        end_step=episode["last"],
        severity=Severity.INFO,
        seen=seen,
        evidence=evidence,
        remedies=remedies,
        advice="lower the LR" if lost else "",
    )


def never_learned(closed: Finding, first: float, last: float) -> Finding:
    """The run that sat above its start for most of its records ends about where it started."""
    return Finding(
        kind=DIVERGENCE,
        step=closed.step,
        end_step=closed.end_step,
        severity=Severity.ERROR,
        seen=f"{closed.seen}; the run never learned: its last loss, {last:.4g}, is about where "
        f"it started ({first:.4g})",
        evidence={**closed.evidence, "first_loss": first, "last_loss": last, "never_learned": 1.0},
        remedies=_LOST,
        advice=closed.advice,
    )


def steps(count: int) -> str:
    """``"1 step"``, ``"5 steps"``."""
    return f"{count} step" if count == 1 else f"{count} steps"


def _evidence(episode: dict[str, Any]) -> dict[str, float]:
    base, peak = episode["baseline"], episode["peak"]
    evidence = {"baseline": base, "baseline_records": episode["baseline_records"], "peak": peak}
    evidence.update(peak_step=episode["peak_step"], ratio=_ratio(peak, base))
    if "level" in episode:
        evidence["level"] = episode["level"]
    return evidence


def _ratio(value: float, baseline: float) -> float:
    return value / baseline if baseline > 0 else float("inf")


def _ratio_text(value: float, baseline: float) -> str:
    """``"3.1x"``, or how far above a baseline that is not positive (an NLL loss below 0)."""
    if baseline > 0:
        return f"{value / baseline:.1f}x"
    return f"+{value - baseline:.4g}"
