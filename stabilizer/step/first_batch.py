"""The first batch's checks: the configuration (``config_risk``) and the causal self-check.

Both read what they need from the host and hand plain tensors and modules to the torch-only
`stabilizer.live.preflight`; each runs the model in a sandbox, with the monitor `quiet` (its
hooks ignore the forward, no optimizer steps). They run once, at the first batch of a run (not
a resumed one). What the host does not tell, the checks derive: whether the LR warms up comes
from the optimizer and its schedulers (`warmup`), the same rule whatever the host.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from stabilizer.core.isolated import Isolated
from stabilizer.core.records import Finding
from stabilizer.live.preflight import (
    causal_by_design,
    causal_self_check,
    config_risks,
    optimizer_risks,
    preflight_switches,
)
from stabilizer.live.sandbox import sandbox

from .host import Host

__all__ = [
    "Preflight",
    "causal_check",
    "config_checks",
    "first_token_batch",
    "preflight",
    "target_batch",
    "warmup",
]

log = logging.getLogger("stabilizer")

_POSITION_ATTRS = ("block_size", "max_position_embeddings", "n_positions", "max_seq_len")
_TARGET_KEYS = ("labels", "label_ids", "lm_labels", "targets", "target", "y")


def config_checks(
    host: Host, batch: Any, switches: Mapping[str, bool] | None = None
) -> list[Finding]:
    """`config_risk` findings from the host's settings and the model.

    Args:
        host: The training loop.
        batch: The first training batch.
        switches: Which checks run (see `stabilizer.live.preflight.preflight_switches`).
    """
    on = preflight_switches(True if switches is None else switches)
    ids = first_token_batch(batch)
    step = host.step
    risky = optimizer_risks(host.optimizers, step) if on["optimizer_eps"] else []
    return risky + config_risks(
        host.module,
        warmup_steps=warmup(host.optimizers, host.schedulers),
        precision=host.facts.precision,
        gradient_clip_val=host.clip,
        seq_len=None if ids is None else ids.size(1),
        max_positions=_max_positions(host.module),
        step=step,
        checks=[name for name, wanted in on.items() if wanted],
    )


def causal_check(
    host: Host, batch: Any, switches: Mapping[str, bool] | None = None
) -> list[Finding]:
    """The causal self-check on the first batch's token ids (when it is switched on and the batch
    has token ids); a model bidirectional by design gets an `info`, not a critical."""
    on = preflight_switches(True if switches is None else switches)
    ids = first_token_batch(batch)
    if not on["causal"] or ids is None or ids.size(1) < 2:
        return []
    bidirectional = causal_by_design(ids, target_batch(batch, ids)) is False
    return causal_self_check(host.module, ids[:2], step=host.step, bidirectional=bidirectional)


def warmup(optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any]) -> int | None:
    """0: the LR starts at its peak (or is constant: no scheduler); 1: it warms up; None: it
    cannot be told (a scheduler that keeps no ``initial_lr``)."""
    if not schedulers or not optimizers:
        return 0
    group = optimizers[0].param_groups[0]
    peak, lr = group.get("initial_lr"), group.get("lr")
    if not isinstance(peak, int | float) or not peak or not isinstance(lr, int | float):
        return None
    return 0 if lr >= 0.5 * peak else 1


def preflight(
    host: Host,
    batch: Any,
    switches: Mapping[str, bool],
    quiet: Callable[[], AbstractContextManager[None]],
    strict: bool,
) -> list[Finding]:
    """The preflight at the first batch: the configuration checks, the causal self-check.

    Each runs the model in a sandbox (nothing stays) with the monitor `quiet` (no optimizer
    steps, its hooks ignore it); a model a check cannot run on (a forward that wants more than
    token ids) loses that check, not the others, nor the monitor.
    """
    found: list[Finding] = []
    for check, what in ((config_checks, "config checks"), (causal_check, "causal self-check")):
        with Isolated(strict) as part, quiet(), sandbox(host.module):
            found += check(host, batch, switches)
        if part.error is not None and host.facts.is_global_zero:
            log.warning("stabilizer: preflight %s skipped: %r", what, part.error)
    return found


class Preflight:
    """The preflight of a run: once, at its first batch (or never: all checks switched off, or
    a resumed run, checked when it started).

    Args:
        switches: Each check's switch (`stabilizer.live.preflight.preflight_switches`).
        strict: Raise a check's error instead of skipping that check.
    """

    def __init__(self, switches: Mapping[str, bool], strict: bool) -> None:
        self.switches, self.strict = switches, strict
        self.done = not any(switches.values())

    def __call__(
        self, host: Host, batch: Any, quiet: Callable[[], AbstractContextManager[None]]
    ) -> list[Finding]:
        """`preflight`'s findings the first time; nothing after."""
        if self.done:
            return []
        self.done = True
        return preflight(host, batch, self.switches, quiet, self.strict)


def first_token_batch(batch: Any) -> torch.Tensor | None:
    """The first 2-D integer tensor of a batch (token ids), searched in order; None if none."""
    if isinstance(batch, torch.Tensor):
        ok = batch.dim() == 2 and not batch.is_floating_point() and not batch.is_complex()
        return batch if ok else None
    if not isinstance(batch, dict | list | tuple):
        return None
    items = batch.values() if isinstance(batch, dict) else batch
    return next((ids for ids in map(first_token_batch, items) if ids is not None), None)


def target_batch(batch: Any, ids: torch.Tensor) -> torch.Tensor | None:
    """The batch's targets for ``ids``: a ``labels``-like entry of a dict, else the next integer
    tensor shaped like ``ids`` that is not a 0/1 mask; None if there is none."""
    if isinstance(batch, dict):
        named = [batch[k] for k in _TARGET_KEYS if isinstance(batch.get(k), torch.Tensor)]
        if named:
            return named[0] if named[0].shape == ids.shape else None
        batch = list(batch.values())
    if not isinstance(batch, list | tuple):
        return None
    shaped = [
        t
        for t in batch
        if isinstance(t, torch.Tensor) and t is not ids and t.shape == ids.shape
        and not t.is_floating_point()
    ]  # fmt: skip
    # An attention mask (or segment ids) holds only 0 and 1: not targets.
    return next((t for t in shaped if not bool(((t == 0) | (t == 1)).all())), None)


def _max_positions(module: nn.Module) -> int | None:
    for owner in (module, getattr(module, "model", None)):
        config = getattr(owner, "config", None)
        for attr in _POSITION_ATTRS:
            value = getattr(config, attr, None)
            if isinstance(value, int):
                return value
    return None
