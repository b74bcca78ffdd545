"""Line shapes that console readers share: a number as printed (`NUM`), a stated vocabulary.

(The fp16 scalers' overflow lines are messages of the trainers' catalogue, `words`.)
"""

from __future__ import annotations

import re

__all__ = ["NUM", "vocab_of"]

NUM = (  # possessive: a number is taken whole or not at all ("308500ms" fails at once);
    # thousands separators ("41,943,040": groups of three after a first digit that is no 0)
    r"[-+]?+(?:[1-9]\d{0,2}+(?:,\d{3}+)++(?!\d)(?:\.\d++)?+|\d++\.?+\d*+(?:[eE][-+]?+\d++)?+"
    r"|\.\d++|[nN]a[nN]|[iI]nf(?:inity)?+)"
)
"""A number as logs print it (a regex): ``3.2e-05``, ``41,943,040``, ``nan``, ``inf``."""

_VOCAB = re.compile(
    r"vocab(?:ulary)?(?:[_ ]?size)?['\"]?\s*(?:[:=]|\(size:|is)\s*(\d{2,7})\b", re.IGNORECASE
)


def vocab_of(line: str) -> float | None:
    """The vocabulary a line states, the largest if several (a padded one): litgpt's
    ``'vocab_size': 50254, ..., 'padded_vocab_size': 50304``, Megatron's ``padded vocab (size:
    50257)``, ``vocab_size = 32000``; else None."""
    found = [int(number) for number in _VOCAB.findall(line)] if "ocab" in line else []
    return float(max(found)) if found else None
