"""Policies: what the monitor does beyond reporting, each with the knobs that apply to it.

- `Observe()`: detect and report; nothing is skipped, checked or changed.
- `Protect(stop_after=10, root_cause=True, guard_optimizer=None)` (the default): decide inside
  every optimizer step, skip a non-finite one, check what is let through, name the module that
  made a NaN, stop a run that stays non-finite (docs/protection.md).
- `Auto(allow=..., ...)`: protect, and apply the remedies of docs/remedies.md to a failure seen
  in the run's own numbers; its knobs are `Protect`'s and the remedies'.

A knob that does not apply cannot be written: ``Observe(stop_after=3)`` is a ``TypeError``, as
Lightning's strategies and optax's transformations take only their own arguments. The names
``"observe"``, ``"protect"`` and ``"auto"`` stand for each with its defaults (`as_policy`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from stabilizer.core.remedies import AUTO_REMEDIES

__all__ = ["POLICIES", "Auto", "Observe", "Policy", "Protect", "as_policy"]


@dataclass(frozen=True)
class Observe:
    """Detect and report only."""

    name: ClassVar[str] = "observe"


@dataclass(frozen=True)
class Protect:
    """Skip non-finite steps, check the weights, name the cause, stop a run that stays broken.

    Args:
        stop_after: Stop after this many non-finite or unchecked steps in a row (of one
            optimizer); None: never (the weights' check still stops a run whose weights turned
            non-finite).
        root_cause: On the first step of each non-finite episode, replay its micro-batches
            under hooks, in a sandbox, and name the module that produced the NaN/Inf (at most
            `max_root_causes` a run).
        guard_optimizer: Copy the parameters and optimizer state before a step and undo the step
            if it made them non-finite: True every step, False none, None where the optimizer's
            own arithmetic can overflow from finite gradients (fp16/bf16 parameters, Adam-style
            ``eps=0``, a huge gradient; LBFGS always).
        max_root_causes: Replays allowed over the run.
    """

    name: ClassVar[str] = "protect"
    stop_after: int | None = 10
    root_cause: bool = True
    guard_optimizer: bool | None = None
    max_root_causes: int = 10

    def __post_init__(self) -> None:
        stop = self.stop_after
        if stop is not None and not (_whole(stop) and stop >= 1):
            raise _kind(stop)(f"`stop_after` must be an int >= 1 or None, got {stop!r}")
        _at_least(self, "max_root_causes", 0)
        if self.guard_optimizer not in (True, False, None):
            raise TypeError(
                f"`guard_optimizer` must be True, False or None, got {self.guard_optimizer!r}"
            )
        if not isinstance(self.root_cause, bool):
            raise TypeError(f"`root_cause` must be True or False, got {self.root_cause!r}")


@dataclass(frozen=True)
class Auto(Protect):
    """Protect, and apply the known remedies to a failure seen in the run's own numbers.

    Args:
        allow: Remedy names that may be applied (default: all of
            `stabilizer.core.remedies.AUTO_REMEDIES`; the model rewrites
            ``upcast_to_fp32`` and ``swap_to_pre_ln`` only on a model trained from scratch:
            no frozen parameter, no pretrained weights; naming a rewrite here allows it on any
            model).
        snapshot_every: Steps between rollback snapshots (taken only after a snapshot interval
            without any finding of WARNING or above).
        keep_snapshots: Snapshots held; a rollback goes to the newest one from before the
            trouble began, which a divergence reports only once the loss has stayed up, so they
            must span more than that.
        max_rollbacks: Rollbacks allowed over the run.
        skip_batches: Optimizer updates skipped after a rollback (past the bad data).
        swap_before: ``depth_imbalance`` at or after this step recommends a restart instead of
            a swap (mid-run surgery on a trained post-LN stack is a gamble).
        warmup_steps: LR warmup re-armed after a swap to pre-LN.
        snapshot_dir: Where snapshots larger than 1 GiB go (default: in memory anyway).
        check_steps: Steps each remedy is watched for before it is said to have worked (for
            ``swap_to_pre_ln``: after its re-warm, ``warmup_steps`` more).
        (and `Protect`'s knobs)
    """

    name: ClassVar[str] = "auto"
    allow: Collection[str] | None = None
    snapshot_every: int = 50
    keep_snapshots: int = 4
    max_rollbacks: int = 3
    skip_batches: int = 20
    swap_before: int = 2000
    warmup_steps: int = 100
    snapshot_dir: str | Path | None = None
    check_steps: int = 50

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.allow, str) or not isinstance(self.allow, Collection | None):
            raise TypeError(
                f"`allow` must be a collection of remedy names or None, got {self.allow!r}"
            )
        unknown = set(self.allow or ()) - set(AUTO_REMEDIES)
        if unknown:
            names = ", ".join(AUTO_REMEDIES)
            raise ValueError(f"`allow` must name remedies among {names}, got {sorted(unknown)}")
        for name in ("max_rollbacks", "swap_before", "warmup_steps"):
            _at_least(self, name, 0)
        for name in ("snapshot_every", "keep_snapshots", "check_steps"):
            _at_least(self, name, 1)
        _at_least(self, "skip_batches", 0)

    @property
    def allowed(self) -> frozenset[str]:
        """The remedies that may be applied."""
        return frozenset(AUTO_REMEDIES if self.allow is None else self.allow)

    @property
    def explicit(self) -> frozenset[str]:
        """The remedies the user named (rewrites among them apply to any model)."""
        return frozenset(self.allow or ())


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: object) -> type[Exception]:
    """ValueError for an int out of range, TypeError for anything else."""
    return ValueError if _whole(value) else TypeError


def _at_least(policy: object, name: str, least: int) -> None:
    value = getattr(policy, name)
    if not (_whole(value) and value >= least):
        raise _kind(value)(f"`{name}` must be an int >= {least}, got {value!r}")


Policy = Observe | Protect | Auto
POLICIES: dict[str, type[Observe] | type[Protect]] = {
    "protect": Protect,
    "observe": Observe,
    "auto": Auto,
}


def as_policy(policy: str | Policy) -> Policy:
    """The policy object a name stands for (with its defaults), or the object itself."""
    if isinstance(policy, Observe | Protect):
        return policy
    if isinstance(policy, str) and policy in POLICIES:
        return POLICIES[policy]()
    names = ", ".join(POLICIES)
    raise ValueError(f"`policy` must be one of {names} or a policy object, got {policy!r}")
