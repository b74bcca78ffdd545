"""`stepped_through`: the optimizer a wrapper optimizer steps its parameters with.

An optimizer that steps *through* another one shares that one's ``param_groups`` (the same
list, or the same group dicts: an LR a scheduler writes to the wrapper is the inner
optimizer's): a Lookahead, whose ``step`` steps the base optimizer and then moves the weights
itself, and sharpness-aware minimization (SAM), whose ``first_step`` and ``second_step`` are
what a loop calls, its base optimizer stepping inside the second — the wrapper's own ``step``
never runs. The guard sits on both (`stabilizer.step.guard.StepGuard`): the wrapper's step is
judged as always, and the inner one's, called on its own, is judged as the wrapper's; a
rollback snapshots the inner one's state beside the wrapper's (`remedies.rollback`). Which
attribute holds it is the wrapper's business, so every attribute is looked at; a
``ZeroRedundancyOptimizer`` keeps groups of its own (its shard's), and is no such wrapper.
"""

from __future__ import annotations

import torch

__all__ = ["stepped_through"]


def stepped_through(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """The torch optimizer, held by `optimizer`, that shares its param groups; None if none."""
    mine = optimizer.__dict__.get("param_groups")
    if not isinstance(mine, list) or not mine:
        return None
    for value in vars(optimizer).values():
        if value is optimizer or not isinstance(value, torch.optim.Optimizer):
            continue
        theirs = value.param_groups
        if theirs is mine or (
            len(theirs) == len(mine) and all(a is b for a, b in zip(mine, theirs, strict=True))
        ):
            return value
    return None
