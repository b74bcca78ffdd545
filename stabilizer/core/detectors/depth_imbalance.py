"""`DepthImbalance`: a band of blocks at one end of the stack starved of gradient."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar

from stabilizer.core.kinds import DEPTH_IMBALANCE, kind_of
from stabilizer.core.records import Finding, Severity, StepRecord
from stabilizer.core.signals import GRAD_NORM_PREFIX, UPDATE_RATIO_PREFIX, block_index

from ._robust import exp10, median
from .base import check_at_least

__all__ = ["EXTREME_RATIO", "DepthImbalance"]

_BLOCKS = GRAD_NORM_PREFIX + "block_"  # the keys of per-block norms
_ADVICE = "switch to pre-LN and keep LR warmup"
EXTREME_RATIO = 1e4
"""An end of the stack this many times below its largest block norm is reported sooner."""


class DepthImbalance:
    """A band of blocks at one end of the stack whose gradients are orders of magnitude smaller.

    Requires: ``grad_norm/block_NN`` for at least `min_blocks` blocks.
    Rule: a band of blocks at one end ≥ `ratio`× below the others' median for `patience` records,
    or, sooner, once the block at that end has had ≤ 1/`extreme_ratio` of the stack's largest
    block norm on each of the last `extreme_patience` records (an end of the stack 1e4 times
    below its other end for ten records in a row is no blip: a post-LN stack that starves that
    hard does not recover, and a swap to pre-LN is worth most early); the band is then the
    blocks from that end ≥ `ratio`× below the largest, and it began on the first of the records
    in a row on which the end block was (when the starving began: a restart goes back before it).

    This is how a deep post-LN stack fails to train (Xiong et al. 2020): gradients vanish towards
    one end. The band is the largest run of blocks from the input (or output) end whose norms all
    lie that far below the median of the remaining blocks (two at least). Norms are compared in
    log10, smoothed per block by an EMA (weight `alpha`), on every record that carries block norms
    (`patience` counts those records, not steps). The extreme rule reads each record's own norms
    (a block missing from a record counts at its EMA) against the largest, not the band against
    the rest's median: post-LN's norms fall geometrically, 0.4-1 decade a block, so the median
    of the rest is itself starved (at 0.4 decades a block no band is ever 100x below it) and the
    EMA lags a gap that opens by decades within tens of steps. A healthy pre-LN stack has larger
    gradients in early blocks than in late ones (NormFormer), typically a smooth 3-10× from
    first to last, far below `ratio`. One WARNING per side per episode, the starved groups as
    location, ``update_ratio/<group>`` as extra evidence, emitted after `patience` records; it
    ends when the band does, with a closing finding of the same start: INFO when the band is
    gone, WARNING "until the end of the log" when the stream ends first. Zero norms are ignored.

    Args:
        ratio: How many times smaller the band's norms must be than the rest's median.
        patience: Consecutive records the band must persist (not a blip).
        extreme_ratio: An end block that gets this many times less than the largest block
            norm is reported sooner (default: `EXTREME_RATIO`, or `ratio` if larger) ...
        extreme_patience: ... once this many consecutive records have shown it.
        alpha: EMA weight of the newest log norm (1 = no smoothing).
        min_blocks: Blocks needed before any decision.
    """

    name: ClassVar[str] = "depth_imbalance"
    requires: ClassVar[tuple[str, ...]] = (GRAD_NORM_PREFIX,)

    def __init__(
        self,
        ratio: float = 100.0,
        patience: int = 50,
        alpha: float = 0.1,
        min_blocks: int = 4,
        extreme_ratio: float | None = None,
        extreme_patience: int = 10,
    ) -> None:
        check_at_least("ratio", ratio, 2.0)
        check_at_least("patience", patience, 1)
        extreme_ratio = max(EXTREME_RATIO, ratio) if extreme_ratio is None else extreme_ratio
        check_at_least("extreme_ratio", extreme_ratio, ratio)
        check_at_least("extreme_patience", extreme_patience, 1)
        self.extreme_ratio, self.extreme_patience = extreme_ratio, extreme_patience
        if not 0 < alpha <= 1:
            raise ValueError(f"`alpha` must be in (0, 1], got {alpha}")
        check_at_least("min_blocks", min_blocks, 4)
        self.ratio, self.gap, self.patience = ratio, math.log10(ratio), patience
        self.extreme_gap = math.log10(extreme_ratio)
        self.alpha, self.min_blocks = alpha, min_blocks
        self._ema: dict[str, float] = {}  # block group -> EMA of log10 norm, as they appeared
        self._order: list[str] = []  # the groups of `_ema` in depth order
        self._streak: dict[str, list[int]] = {}  # side -> [first step, records, last step]
        self._raw: dict[str, float] = {}  # block group -> log10 norm on the latest record
        self._extreme: dict[str, int] = {}  # side -> consecutive records with an extreme gap
        self._onset: dict[str, list[int]] = {}  # side -> [first step, records] of its end
        # block at >= `ratio`x below the largest: when the starving began
        self._open: dict[str, Finding] = {}  # side -> the finding that reported its band

    def update(self, record: StepRecord) -> list[Finding]:
        if not self._smooth(record.values) or len(self._ema) < self.min_blocks:
            return []
        ordered = self._order
        levels = [self._ema[group] for group in ordered]
        raw = [self._raw.get(group, self._ema[group]) for group in ordered]  # this record's
        top = max(raw)
        findings: list[Finding] = []
        for side, groups, side_levels, end in (
            ("input", ordered, levels, raw[0] - top),
            ("output", ordered[::-1], levels[::-1], raw[-1] - top),
        ):  # `end`: the end block's log10 norm against the largest, on this record
            self._extreme[side] = self._extreme.get(side, 0) + 1 if end <= -self.extreme_gap else 0
            if end <= -self.gap:
                self._onset.setdefault(side, [record.step, 0])[1] += 1
            else:
                self._onset.pop(side, None)
            finding = self._check_side(record, side, groups, side_levels, end)
            if finding is not None:
                findings.append(finding)
        return findings

    def _smooth(self, values: Mapping[str, float]) -> bool:
        """Move each block's EMA towards the record's finite positive norm; whether any was."""
        updated = False
        self._raw.clear()
        for key, value in values.items():
            if not key.startswith(_BLOCKS) or not 0.0 < value < math.inf:
                continue
            group, level = key[len(GRAD_NORM_PREFIX) :], math.log10(value)
            old = self._ema.get(group)
            if old is not None:
                self._ema[group] = old + self.alpha * (level - old)
            elif block_index(group) is not None:  # a new block: it starts at its first norm
                self._ema[group] = level
                self._order = _depth_order(self._ema)
            else:
                continue
            self._raw[group] = level
            updated = True
        return updated

    def _check_side(
        self, record: StepRecord, side: str, groups: list[str], levels: list[float], end: float
    ) -> Finding | None:
        size = _band(levels, self.gap)
        extreme = self._extreme.get(side, 0)
        if extreme >= self.extreme_patience or side in self._open:
            size = max(size, _below_largest(levels, self.gap))
        if size == 0:
            streak, opened = self._streak.pop(side, None), self._open.pop(side, None)
            if streak is None or opened is None:
                return None
            top, low = int(opened.evidence["band_first"]), int(opened.evidence["band_last"])
            seen = (
                f"{side} side: blocks {top}-{low} back within {self.ratio:g}x of the rest's "
                f"gradient at step {record.step}, after {streak[1]} records"
            )
            return replace(opened, end_step=streak[2], severity=Severity.INFO, seen=seen, advice="")
        streak = self._streak.setdefault(side, [record.step, 0, record.step])
        streak[1], streak[2] = streak[1] + 1, record.step
        if extreme >= self.extreme_patience and side not in self._open:  # it began back then
            onset, records = self._onset.get(side, [record.step, extreme])
            streak[0], streak[1] = min(streak[0], onset), max(streak[1], records)
        if side in self._open or (streak[1] < self.patience and extreme < self.extreme_patience):
            return None
        band, rest = groups[:size] if side == "input" else groups[size - 1 :: -1], groups[size:]
        ema = self._ema
        levels = [ema[g] for g in band]
        rest_level = median([ema[g] for g in rest])
        ratio = exp10(rest_level - max(levels))
        first, last = block_index(band[0]), block_index(band[-1])
        evidence = {"band_min": exp10(min(levels)), "band_max": exp10(max(levels))}
        evidence.update(rest_median=exp10(rest_level), ratio=ratio, band_first=first or 0)
        evidence.update(band_last=last or 0, blocks=len(groups))
        evidence.update(_update_ratios(record.values, band, rest))
        if extreme >= self.extreme_patience:  # what the extreme rule read
            evidence["end_share"] = exp10(end)
        self._open[side] = Finding(
            kind=DEPTH_IMBALANCE,
            step=streak[0],
            end_step=record.step,
            severity=Severity.WARNING,
            seen=f"{_blocks(side, evidence)} for {streak[1]} records",
            evidence=evidence,
            location=tuple(band),
            remedies=kind_of(DEPTH_IMBALANCE).remedies,
            advice=_ADVICE,
        )
        return self._open[side]

    def finish(self) -> list[Finding]:
        found = []
        for side, opened in sorted(self._open.items()):
            streak = self._streak[side]
            span = f"from step {streak[0]} until the end of the log ({streak[1]} records)"
            seen = f"{_blocks(side, opened)} {span}"
            found.append(replace(opened, end_step=streak[2], seen=seen))
        self._streak.clear()
        self._open.clear()
        return found

    def state_dict(self) -> dict[str, Any]:
        streak = {side: list(value) for side, value in self._streak.items()}
        opened = {side: finding.to_dict() for side, finding in self._open.items()}
        extreme, onset = dict(self._extreme), {s: list(v) for s, v in self._onset.items()}
        return {
            "ema": dict(self._ema), "streak": streak, "open": opened, "extreme": extreme,
            "onset": onset,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._ema = {str(g): float(v) for g, v in state["ema"].items()}
        self._order = _depth_order(self._ema)
        self._streak = {str(s): [int(v) for v in value] for s, value in state["streak"].items()}
        self._open = {str(s): Finding.from_dict(data) for s, data in state["open"].items()}
        self._extreme = {str(s): int(n) for s, n in state.get("extreme", {}).items()}
        onset = state.get("onset", {})
        self._onset = {str(s): [int(v) for v in value] for s, value in onset.items()}


def _blocks(side: str, opened: Finding | Mapping[str, float]) -> str:
    """``input side: blocks 0-5 get 2e-09x to 6e-03x the gradient of the rest (norms 5e-12 to
    1e-05, the rest's median 2e-03)``, from a finding's evidence: the whole band, its most
    starved block too, as the evidence and the heatmap show it."""
    evidence = opened.evidence if isinstance(opened, Finding) else opened
    first, last = int(evidence["band_first"]), int(evidence["band_last"])
    low, high, rest = evidence["band_min"], evidence["band_max"], evidence["rest_median"]
    share = f"{high / rest:.0e}x"
    norms = f"{high:.0e}"
    if f"{low / rest:.0e}" != f"{high / rest:.0e}":
        share, norms = f"{low / rest:.0e}x to {share}", f"{low:.0e} to {norms}"
    where = f"{side} side: blocks {first}-{last}"
    norms += f", the rest's median {rest:.0e}"
    if "end_share" in evidence:  # called on the extreme rule: the end against the largest
        end = first if side == "input" else last
        norms += f"; block {end} at {evidence['end_share']:.0e}x the largest block's"
    return f"{where} get {share} the gradient of the rest (norms {norms})"


def _depth_order(groups: Iterable[str]) -> list[str]:
    """Block groups in depth order (ties: in the order given)."""
    return sorted(groups, key=lambda group: block_index(group) or 0)


def _band(levels: Sequence[float], gap: float) -> int:
    """Size of the largest prefix whose levels all lie ≥ gap below the median of the rest (≥ 2)."""
    best, ceiling = 0, max(levels) - gap
    for size in range(1, len(levels) - 1):
        top = max(levels[:size])
        if top > ceiling:  # the rest's median is at most the maximum: no larger band can pass
            break
        if top <= median(levels[size:]) - gap:
            best = size
    return best


def _below_largest(levels: Sequence[float], gap: float) -> int:
    """Size of the largest prefix whose levels all lie ≥ gap below the largest level (one block
    at least is left out)."""
    ceiling, size = max(levels) - gap, 0
    while size < len(levels) - 1 and levels[size] <= ceiling:
        size += 1
    return size


def _update_ratios(
    values: Mapping[str, float], band: list[str], rest: list[str]
) -> dict[str, float]:
    """Median update ratios of the band and of the rest, when logged and finite."""
    evidence = {}
    for name, groups in (("update_ratio_band", band), ("update_ratio_rest", rest)):
        found = [values.get(UPDATE_RATIO_PREFIX + g, math.nan) for g in groups]
        found = [v for v in found if math.isfinite(v)]
        if found:
            evidence[name] = median(found)
    return evidence
