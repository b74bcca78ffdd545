"""`BlockLevels`: the per-block smoothed log10 gradient norms that `DepthImbalance` compares."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from math import isfinite, log10
from operator import itemgetter
from typing import Any

from stabilizer.core.signals import GRAD_NORM_PREFIX, block_index

__all__ = ["BLOCK_PREFIX", "BlockLevels"]

BLOCK_PREFIX = GRAD_NORM_PREFIX + "block_"
_CUT = len(GRAD_NORM_PREFIX)
_MAX_PLANS = 256  # key tuples remembered; past that the memo starts over

_Plan = tuple[list[str], "list[int] | None", "itemgetter[Any] | None"]


class BlockLevels:
    """An EMA (weight ``alpha``) of log10 ``grad_norm/block_NN`` per block group.

    A group starts at its first finite positive norm; later ones move it by ``alpha`` of the way.
    `order` lists the groups in depth order (ties by appearance), `levels` their EMAs. How a record
    maps onto them is worked out once per tuple of keys: usually each record holds every group, in
    depth order, and the update is one list comprehension.

    Args:
        alpha: EMA weight of the newest log norm (1 = no smoothing).
    """

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.load({})

    def load(self, ema: Mapping[str, float]) -> None:
        """Set the EMAs (group -> level, in order of appearance); `state` gives them back."""
        self.added = list(ema)  # groups in order of appearance
        self.order = sorted(self.added, key=lambda g: block_index(g) or 0)
        self.levels = [float(ema[g]) for g in self.order]
        self.index = {group: i for i, group in enumerate(self.order)}
        self.finite = all(map(isfinite, self.levels))  # stays so: EMAs of finite logs are finite
        self._plans: dict[tuple[str, ...], _Plan] = {}  # record keys -> how to read them

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_plans": {}}  # the memo stays behind

    def state(self) -> dict[str, float]:
        """The EMAs by group, in order of appearance."""
        ema = dict(zip(self.order, self.levels, strict=True))
        return {group: ema[group] for group in self.added}

    def update(self, values: Mapping[str, float]) -> bool:
        """Smooth in a record's finite positive block norms; whether it had any."""
        keys = tuple(values)
        blocks, positions, full = self._plans.get(keys) or self._plan(keys)
        norms = full(values) if full else [values[key] for key in blocks]
        if positions is None:
            return self._add(blocks, norms)
        if full and min(norms) > 0.0 and sum(norms) < math.inf:  # so all finite and positive
            alpha = self.alpha  # every group, in depth order
            pairs = zip(self.levels, norms, strict=False)  # as long: (strict=True is slower)
            self.levels = [e + alpha * (log10(v) - e) for e, v in pairs]
            return True
        levels, alpha, updated = self.levels, self.alpha, False
        for at, value in zip(positions, norms, strict=True):
            if 0.0 < value < math.inf:
                levels[at] += alpha * (log10(value) - levels[at])
                updated = True
        return updated

    def _plan(self, keys: tuple[str, ...]) -> _Plan:
        """A record's block keys, their positions in `levels` (None when one is a new group), and
        when they are every group (two or more) in depth order, a getter of their norms."""
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        blocks = [
            key
            for key in keys
            if key.startswith(BLOCK_PREFIX)
            and (key[_CUT:] in self.index or block_index(key[_CUT:]) is not None)
        ]
        at = [self.index.get(key[_CUT:], -1) for key in blocks]
        full = len(blocks) > 1 and at == list(range(len(self.levels)))
        plan = blocks, None if -1 in at else at, itemgetter(*blocks) if full else None
        self._plans[keys] = plan
        return plan

    def _add(self, blocks: list[str], norms: Sequence[float]) -> bool:
        """`update` for a record that brings new groups."""
        ema, updated = self.state(), False
        for key, value in zip(blocks, norms, strict=True):
            if 0.0 < value < math.inf:
                group, level = key[_CUT:], log10(value)
                if group in ema:
                    level = ema[group] + self.alpha * (level - ema[group])
                ema[group] = level
                updated = True
        self.load(ema)
        return updated
