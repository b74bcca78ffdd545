"""Chance level: the loss of a model that guesses uniformly over N outputs is ln(N).

A cross-entropy loss that sits at ln(N) for a vocabulary or class count a person recognises
(`VOCABULARIES`, `CLASSES`, a few outputs `FEW` — ln 2 for a pairwise preference — or the
vocabulary the log states) is the loss of a model that has learnt nothing: it gives every token
or class the same probability, whatever the input. `Stall` uses `ChanceWatch` to say so on any
stretch of the run, an excerpt from mid-run included.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_right
from collections import deque
from collections.abc import Iterable
from typing import Any, NamedTuple

from stabilizer.core.kinds import STALL, kind_of
from stabilizer.core.records import Finding, Severity

__all__ = [
    "CLASSES",
    "FEW",
    "RECORDS",
    "UNIFORM_RECORDS",
    "VOCABULARIES",
    "Chance",
    "ChanceWatch",
    "chance_of",
    "near_some",
]

VOCABULARIES = (
    30522,  # BERT (uncased)
    32000,  # LLaMA 1/2, Mistral 7B v0.1
    32100,  # T5
    32768,  # Mistral v0.3, Mixtral 8x22B
    49152,  # StarCoder, SmolLM
    50257,  # GPT-2, GPT-3
    50277,  # GPT-NeoX, Pythia (unpadded)
    50304,  # GPT-2 / Pythia padded to a multiple of 64 / 128 (nanoGPT, litgpt)
    64000,  # Yi
    65024,  # Falcon, ChatGLM2
    65536,  # RWKV World (2^16; DINO's default head too)
    100277,  # cl100k (GPT-4, GPT-3.5)
    128256,  # Llama 3
    151936,  # Qwen 1.5/2/2.5 (padded)
    250002,  # XLM-R, mT5 (250112: 0.02% away)
    256000,  # Gemma
)
"""Common tokenizer sizes: ln of them is 10.3-12.5, where no healthy language model stays past
its first steps; the loss must sit within `NEAR_VOCABULARY` of one."""

CLASSES = (10, 100, 1000)
"""Round class counts (CIFAR-10, CIFAR-100, ImageNet): ln of them is 2.30, 4.61, 6.91, where
healthy language models pass or plateau, so the loss must sit within `NEAR_CLASSES`: a uniform
guess gives ln(N) to the fourth digit, a healthy plateau wanders more than that."""

FEW = tuple(range(2, 21))
"""Small output counts: ln 2 = 0.6931 is the chance level of a pairwise preference loss (DPO,
a reward model's Bradley-Terry loss: chosen and rejected scored alike) and of a binary label;
ln 3 ... ln 20 those of a few classes or a multiple choice (QuALITY's four options: ln 4 =
1.3863). Healthy runs pass and plateau here (an LM's 2.3-3.0 holds ln 10 ... ln 20), so the
loss must sit within `NEAR_UNIFORM` of ln N and be the same number record after record (within
`SAME`): a model that gives every output the same probability prints ln N to the last digit,
while a plateau, however smooth, moves in it. Past 20 the levels crowd closer than that band."""

NEAR_VOCABULARY = 0.01  # of ln(N): within 1% (and the vocabulary the log states)
NEAR_CLASSES = 0.002  # of ln(N): within 0.2%
NEAR_UNIFORM = 0.0005  # of ln(N): within 0.05%, a uniform guess to the fourth digit
SAME = 0.0001  # of ln(N): losses no further apart are the same number (to the printed digit)
RECORDS = 8  # losses in a row at chance level that make a stall
UNIFORM_RECORDS = 4  # ... on a uniform guess to the fourth digit, the LR steady
_FALL = 0.002  # of ln(N): a fall from the first half of the stretch to the second is learning
_FEW_WHAT = {2: "outputs (the two of a pairwise preference loss, or of a binary label)"}


class Chance(NamedTuple):
    """A chance level: the count of outputs, ln of it, how near a loss must sit to it (a
    fraction of it), and what the outputs are, in words."""

    outputs: int
    level: float
    near: float
    what: str = "tokens"
    same: bool = False  # the losses at it must be the same number (`SAME`), not only near it

    def holds(self, loss: float) -> bool:
        """Whether ``loss`` sits at this level."""
        return abs(loss - self.level) <= self.near * self.level


def _levels(stated: float | None, near: float | None) -> list[Chance]:
    """Every chance level: the tokenizers', the class counts', the one the log states."""
    levels = [Chance(n, math.log(n), near or NEAR_VOCABULARY) for n in VOCABULARIES]
    levels += [Chance(n, math.log(n), near or NEAR_CLASSES, "classes") for n in CLASSES]
    few = _FEW_WHAT
    levels += [Chance(n, math.log(n), NEAR_UNIFORM, few.get(n, "classes"), True) for n in FEW]
    if stated is not None and stated >= 2:
        what = "tokens or classes (as the log states)"
        levels.append(Chance(round(stated), math.log(stated), near or NEAR_VOCABULARY, what))
    return levels


def chance_of(
    losses: Iterable[float],
    stated: float | None = None,
    near: float | None = None,
    same: bool = False,
) -> Chance | None:
    """The chance level at which ``losses`` (in log order) sit, or None.

    Every loss within the band of one ln(N) (`NEAR_VOCABULARY` for a vocabulary or the one the
    log states, `NEAR_CLASSES` for a class count; ``near`` for all, when given), the same number
    throughout where the level asks it (`FEW`) or ``same`` does, and no fall: the median of the
    second half no lower than that of the first by `_FALL` of ln(N) (a run that learns slowly
    falls steadily, within any band). Of two levels, the nearest to the median.
    """
    values = list(losses)
    if not values or min(values) <= 0.0:
        return None
    spread = max(values) - min(values)
    found = [
        chance
        for chance in _levels(stated, near)
        if all(map(chance.holds, values))
        and (spread <= SAME * chance.level or not (same or chance.same))
    ]
    middle = _median(values)
    best = min(found, key=lambda chance: abs(middle - chance.level), default=None)
    if best is None or len(values) < 2:
        return best
    half = len(values) // 2
    falls = _median(values[half:]) < _median(values[:half]) - _FALL * best.level
    return None if falls else best


_BANDS = sorted((c.level * (1 - c.near), c.level * (1 + c.near)) for c in _levels(None, None))
_LOWS = [low for low, _ in _BANDS]
_REACH = list(itertools.accumulate((high for _, high in _BANDS), max))  # the highest end so far


def near_some(loss: float, stated: float | None) -> bool:
    """Whether ``loss`` is within the band of some chance level (one bisection: of the bands
    that begin below it, the one that reaches highest holds it, if any does)."""
    at = bisect_right(_LOWS, loss)
    if at and loss <= _REACH[at - 1]:
        return True
    return (
        stated is not None
        and stated >= 2
        and any(c.holds(loss) for c in _levels(stated, None)[-1:])
    )


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


class ChanceWatch:
    """Stretches of the run flat at chance level: each one ``stall`` episode, reported when its
    `RECORDS` losses are in, and again (the same start, a later end) when it ends longer.

    At the start of training (``start``: the stream began there and this is before the `Stall`
    check) the losses must sit within `NEAR_UNIFORM` of ln(N): a from-scratch model sits near
    chance while its LR warms up, but only a uniform guess stays there to the fourth digit.
    """

    def __init__(self) -> None:
        self.recent: deque[tuple[int, float]] = deque(maxlen=RECORDS)
        self.open: Chance | None = None  # the level of the stretch reported, while it lasts
        self.start = self.end = self.reported = 0  # its first and last step; the last reported
        self.count = 0  # its records
        self.level = 0.0  # the median loss of its first records
        self.silenced = False  # the run's stall is reported already (`Stall`'s start rule)

    def update(
        self, step: int, loss: float, stated: float | None, start: bool, steady: bool = False
    ) -> list[Finding]:
        """Take a finite loss (at a non-zero LR; ``steady``: logged, not rising); the findings
        it settles."""
        if self.open is not None:
            if self.open.holds(loss):
                self.end, self.count = step, self.count + 1
                return []
            return self.finish("")
        if not near_some(loss, stated):  # (most losses: one bisection)
            if self.recent:
                self.recent.clear()
            return []
        self.recent.append((step, loss))
        settled = self._settled(stated, start, steady)
        if settled is None:
            return []
        found, first = settled
        losses = [value for _, value in self.recent][first:]
        self.open, self.start, self.end = found, self.recent[first][0], step
        self.reported, self.count, self.level = step, len(losses), _median(losses)
        return [self._finding(found, "")]

    def _settled(
        self, stated: float | None, start: bool, steady: bool
    ) -> tuple[Chance, int] | None:
        """The level the recent losses sit at and where their stretch begins, once it is
        evidence: `RECORDS` losses in the level's band (the uniform band at the start of
        training), or, with the LR steady (logged, not warming up), `UNIFORM_RECORDS` in the
        uniform band, the same number each: a loss printed on a uniform guess to the last digit
        while the optimizer steps at its full LR has nothing more to show, at the start as
        later (a DPO loss at 0.6931 at steps 7-10 of a run at LR 1e-5: it leaves ln 2 within a
        step or two when it learns)."""
        losses = [value for _, value in self.recent]
        last = losses[-UNIFORM_RECORDS:]
        if steady and len(last) == UNIFORM_RECORDS and max(last) - min(last) <= SAME * last[0]:
            found = chance_of(last, stated, NEAR_UNIFORM, same=True)
            if found is not None:
                return found, len(losses) - UNIFORM_RECORDS
        if len(losses) < RECORDS:
            return None
        found = chance_of(losses, stated, NEAR_UNIFORM if start else None)
        return None if found is None else (found, 0)

    def whole_log(self, stated: float | None) -> list[Finding]:
        """End of a log too short for a stretch, past the start of its run, whose every loss is
        in ``recent``: at chance level if they are all one number on a uniform guess
        (llm-shearing#24: one record at batch 366, CE 10.3750 = ln 32000, perplexity 32048)."""
        if self.open is not None or not self.recent:
            return []
        losses = [value for _, value in self.recent]
        found = chance_of(losses, stated, NEAR_UNIFORM, same=True)
        if found is None:
            return []
        self.open, self.start, self.end = found, self.recent[0][0], self.recent[-1][0]
        self.reported, self.count, self.level = self.end, len(losses), _median(losses)
        self.open = None
        return [self._finding(found, ", the whole log")]

    def finish(self, until: str = ", to the end of the log") -> list[Finding]:
        """The end of the stretch (``until``: of the log): its final span, if it grew after it
        was reported."""
        chance, self.open = self.open, None
        self.recent.clear()
        if chance is None or self.end == self.reported:
            return []
        return [self._finding(chance, until)]

    def _finding(self, chance: Chance, until: str) -> Finding:
        level = self.level
        span = f"steps {self.start}-{self.end}{until}"
        return Finding(
            kind=STALL,
            step=self.start,
            end_step=self.end,
            severity=Severity.WARNING,
            seen=f"loss flat at {level:.5g} for {self.count} records ({span}): chance level, "
            f"ln({chance.outputs}) = {chance.level:.5g}, the loss of a uniform guess over "
            f"{chance.outputs} {chance.what}: the run has learnt nothing; check the LR (far too "
            "high or too low), frozen parameters and the labels",
            evidence={
                "chance": chance.level,
                "outputs": float(chance.outputs),
                "level": level,
                "records": float(self.count),
            },
            remedies=kind_of(STALL).remedies,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "recent": [list(entry) for entry in self.recent],
            "open": None if self.open is None else list(self.open),
            "span": [self.start, self.end, self.reported, self.count],
            "level": self.level,
            "silenced": self.silenced,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recent = deque(((int(s), float(v)) for s, v in state["recent"]), maxlen=RECORDS)
        opened = state["open"]
        self.open = None
        if opened is not None:
            outputs, level, near, what, *same = opened  # (no `same` in earlier checkpoints)
            self.open = Chance(int(outputs), float(level), float(near), str(what), bool(same))
        self.start, self.end, self.reported, self.count = (int(v) for v in state["span"])
        self.level = float(state["level"])
        self.silenced = bool(state["silenced"])
