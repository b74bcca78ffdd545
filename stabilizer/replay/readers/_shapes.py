"""Line shapes that console readers share: a number as printed (`NUM`) and fp16 overflow lines.

An overflow line of any trainer (``OVERFLOW!``, ``overflow detected, setting loss scale to``,
``Gradient overflow. Skipping step``, ``Attempted loss scale: X, reducing to Y``, guided
diffusion's ``Found NaN, decreased lg_loss_scale to X``) is a skipped step, with the scale in
force after it and the rank that printed it, if named. The universal reader reads them, and so
does the HF Trainer's, whose console DeepSpeed and apex print into.
"""

from __future__ import annotations

import re

from stabilizer.core.signals import LOSS_SCALE, SKIPPED

__all__ = [
    "NUM",
    "OVERFLOW_NEEDS",
    "Overflow",
    "overflow_in",
    "overflow_of",
    "printed_again",
    "vocab_of",
]

NUM = (  # possessive: a number is taken whole or not at all ("308500ms" fails at once);
    # thousands separators ("41,943,040": groups of three after a first digit that is no 0)
    r"[-+]?+(?:[1-9]\d{0,2}+(?:,\d{3}+)++(?!\d)(?:\.\d++)?+|\d++\.?+\d*+(?:[eE][-+]?+\d++)?+"
    r"|\.\d++|[nN]a[nN]|[iI]nf(?:inity)?+)"
)
"""A number as logs print it (a regex): ``3.2e-05``, ``41,943,040``, ``nan``, ``inf``."""

_OVERFLOWS = (  # (what every such line holds, lower-cased; the pattern)
    ("overflow", r"overflow(?:!| detected|\.\s+skipping)|grad(?:ient)? overflow"),
    ("loss scale", r"(?:reducing dynamic|attempted) loss scale"),
    ("lg_loss", r"found nan, decreased lg_loss_scale"),
)
"""The overflow lines: a line that holds none of the first column is none (a cheap test)."""
OVERFLOW_NEEDS = tuple(needs for needs, _ in _OVERFLOWS)
"""What a lower-cased line must hold one of to be an overflow line (for `overflow_in`)."""
_OVERFLOW = re.compile("|".join(pattern for _, pattern in _OVERFLOWS))
_LG = "lg_loss_scale"
_LG_SCALE = re.compile(r"lg_loss_scale to\s*(" + NUM + ")")  # guided diffusion: log2 of the scale
_NEW_SCALE = re.compile(
    r"(?:reducing (?:loss scale )?to|setting loss scale to:?|loss scale from \S+ to)\s*("
    + NUM
    + ")"
)
_ATTEMPTED = re.compile(r"attempted loss scale:?\s*(" + NUM + ")")
_RANK = re.compile(r"\brank\s*(\d+)")

Overflow = tuple[dict[str, float], int | None]
"""An overflow line's record (a skipped step, the scale in force after it) and the rank it names."""


def printed_again(line: str, found: Overflow, last_line: str, last: Overflow) -> bool:
    """Whether an overflow line is the last one printed again (by another rank or logger): the
    scale it names, if any, is the last one's, and it is not the same rank reporting anew at
    another time (at the floor the scale stays 1, skip after skip)."""
    (values, rank), (last_values, last_rank) = found, last
    scale = values.get(LOSS_SCALE)
    same = scale is None or last_values.get(LOSS_SCALE, scale) == scale
    same = same and values.get(_LG) == last_values.get(_LG)
    return same and not (rank is not None and rank == last_rank and line != last_line)


def overflow_of(line: str) -> Overflow | None:
    """The record of an fp16 overflow line and the rank it names, if any; None for any other."""
    low = line.lower()
    return overflow_in(low) if any(map(low.__contains__, OVERFLOW_NEEDS)) else None


def overflow_in(low: str) -> Overflow | None:
    """`overflow_of` a lower-cased line that holds one of `OVERFLOW_NEEDS`."""
    if _OVERFLOW.search(low) is None:
        return None
    rank = _RANK.search(low)
    return _overflow(low), rank and int(rank[1])


def _overflow(low: str) -> dict[str, float]:
    """The record of an overflow line: a skipped step, and the scale in force after it."""
    scale = _NEW_SCALE.search(low) or _ATTEMPTED.search(low)  # (hysteresis keeps the scale)
    if scale is not None:
        return {SKIPPED: 1.0, LOSS_SCALE: float(scale[1].replace(",", ""))}
    lg = _LG_SCALE.search(low)
    if lg is not None:  # "Found NaN, decreased lg_loss_scale to -16199.354": 2 to that power
        power = float(lg[1].replace(",", ""))  # (kept too: below 2^-1074 every scale is the same 0)
        return {SKIPPED: 1.0, LOSS_SCALE: 2.0 ** max(min(power, 1000.0), -1075.0), _LG: power}
    return {SKIPPED: 1.0}


_VOCAB = re.compile(
    r"vocab(?:ulary)?(?:[_ ]?size)?['\"]?\s*(?:[:=]|\(size:|is)\s*(\d{2,7})\b", re.IGNORECASE
)


def vocab_of(line: str) -> float | None:
    """The vocabulary a line states, the largest if several (a padded one): litgpt's
    ``'vocab_size': 50254, ..., 'padded_vocab_size': 50304``, Megatron's ``padded vocab (size:
    50257)``, ``vocab_size = 32000``; else None."""
    found = [int(number) for number in _VOCAB.findall(line)] if "ocab" in line else []
    return float(max(found)) if found else None
