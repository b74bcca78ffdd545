"""Logged metric names → signal keys, shared by the readers of structured logs (`KeyMap`).

- The monitor's own ``stability/<key>`` tags lose their prefix; its outputs that are no signal
  (``stability/finding/<kind>``, ``stability/grad_norm_log10/<group>``) are dropped.
- Names map through the one alias table (`aliases.ALIASES`) after dropping a ``train/``,
  ``train_`` or ``training/`` prefix and a ``_step`` suffix (``train/loss_step`` is the loss,
  ``train/loss_epoch`` and ``val/loss`` are not), less `CONSOLE_ONLY`.
- Learning-rate tags (Lightning's ``lr-<Optimizer>``, Ultralytics' ``lr/pg0``) are `LR`;
  fairseq's ``clip`` percentage is `CLIPPED` in 0..1; Lightning's ``grad_2.0_norm/<parameter>``
  combine into ``grad_norm/<group>`` (root of the sum of squares per depth group).
- Any other name passes through unchanged: detectors ignore keys they do not know.

The rules in full, and why: docs/readers.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from stabilizer.core.groups import depth_group
from stabilizer.core.signals import (
    CLIPPED,
    GRAD_NORM,
    LR,
    VIEWS,
    group_key,
    strip_prefix,
)

from . import aliases

__all__ = ["ALIASES", "CONSOLE_ONLY", "PCT", "SET", "SUMSQ", "KeyMap"]

SET, SUMSQ, PCT = 0, 1, 2  # how a value lands on its key: as is, squares summed, percent → 0..1

CONSOLE_ONLY = frozenset(("nll_loss", "norm"))
"""Names of the alias table that a structured log's names do not mean: it names every metric it
has, so fairseq's ``nll_loss`` beside its ``loss`` is not the loss again, and a bare ``norm`` (a
weight norm, a layer's norm) is only llm.c's console shorthand for the gradient norm."""

ALIASES: dict[str, str] = {
    **{name: key for name, key in aliases.ALIASES.items() if name not in CONSOLE_ONLY},
    "grad_2.0_norm_total": GRAD_NORM,  # Lightning's grad_norm() utility
}
"""Lower-case metric names (without ``train/`` prefixes) that mean a signal key."""

_PARAM_NORM = "grad_2.0_norm/"
_FIRST_GROUP_LR = frozenset(("lr/pg0", "x/lr0"))  # Ultralytics' results.csv: v8+, YOLOv5
_PREFIXES = ("train/", "train_", "training/")


def _lookup(name: str, passthrough: bool) -> tuple[str, int] | None:
    tag = strip_prefix(name)
    if tag.startswith(("finding/", *VIEWS)):
        return None
    if tag is not name:  # the monitor's own tags are signal keys already
        return tag, SET
    if tag.startswith(_PARAM_NORM):
        return group_key(depth_group(tag[len(_PARAM_NORM) :])), SUMSQ
    base = tag.lower()
    for prefix in _PREFIXES:
        if base.startswith(prefix):
            base = base[len(prefix) :]
            break
    base = base.removesuffix("_step")
    if base in ALIASES:
        return ALIASES[base], SET
    if base == "clip":
        return CLIPPED, PCT
    if base.startswith("lr-") and ("/" not in base or base.endswith("/pg1")):
        return LR, SET
    if base in _FIRST_GROUP_LR:
        return LR, SET
    return (tag, SET) if passthrough else None


class KeyMap:
    """Maps the names of one log to signal keys, remembering each name's mapping.

    Args:
        passthrough: Keep names that are no alias under their own name (else drop them).
    """

    def __init__(self, passthrough: bool = True) -> None:
        self.passthrough = passthrough
        self._cache: dict[str, tuple[str, int] | None] = {}

    def lookup(self, name: str) -> tuple[str, int] | None:
        """``(key, how)`` for a logged name, or None when it is dropped."""
        if name not in self._cache:
            if len(self._cache) > 100_000:  # a log with endless distinct names: bound the cache
                self._cache.clear()
            self._cache[name] = _lookup(name, self.passthrough)
        return self._cache[name]

    def values(self, raw: Mapping[str, float]) -> dict[str, float]:
        """The signal values of one step's logged ``name -> value`` pairs (later pairs win)."""
        out: dict[str, float] = {}
        squares: dict[str, float] = {}
        cache = self._cache
        for name, value in raw.items():
            found = cache[name] if name in cache else self.lookup(name)
            if found is None:
                continue
            key, how = found
            if how == SET:
                out[key] = value
            elif how == SUMSQ:
                squares[key] = squares.get(key, 0.0) + value * value
            else:
                out[key] = value / 100.0
        for key, total in squares.items():
            out[key] = math.sqrt(total)
        return out

    def rename(self, pairs: Sequence[tuple[str, str]]) -> dict[str, float]:
        """`values` of ``(name, number text)`` pairs of a console line (texts that are no number
        are left out)."""
        raw: dict[str, float] = {}
        for name, text in pairs:
            try:
                raw[name] = float(text)
            except ValueError:
                continue
        return self.values(raw)
