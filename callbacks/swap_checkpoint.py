"""Checkpoints of a run that `auto` moved to pre-LN load back into the model it became.

``swap_to_pre_ln`` changes the model: the blocks' norm placement (not in the state dict) and,
for an ``nn.TransformerEncoder``/``Decoder`` without a final norm, a new ``<stack>.norm``
(``Unexpected key(s) in state_dict: "encoder.norm.weight"`` when loaded into a fresh model).
The monitor's state in the checkpoint records that the swap was applied (``auto.applied``);
`restore_pre_ln` reads that record and applies the same swap to a fresh model before its
weights load:

- ``Trainer(callbacks=[StabilityMonitor(policy="auto")]).fit(model, ckpt_path=...)``: the
  monitor does it (`watch_checkpoint_loads`), and adds the new norm's parameters to the
  optimizer as the original run did, so that the optimizer state loads too;
- ``MyModule.load_from_checkpoint(path)``: Lightning calls the module's ``on_load_checkpoint``
  first; call `restore_pre_ln` there (the reference ``LitGPT`` does)::

      def on_load_checkpoint(self, checkpoint):
          restore_pre_ln(self, checkpoint)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
from torch import nn

from stabilizer.live.remedies import swap_to_pre_ln
from stabilizer.live.remedies.swap_to_pre_ln import SwapReport

__all__ = ["add_param_group", "restore_pre_ln", "swapped_in", "watch_checkpoint_loads"]


def add_param_group(trainer: pl.Trainer, params: list[nn.Parameter]) -> None:
    """Add ``params`` to the first optimizer as a new group, and the group to its schedulers.

    Parameters already in a group (a model swapped while loading, before the optimizer was
    made) move to the new group, as the checkpoint's optimizer state has them. A scheduler keeps
    one entry per group (``base_lrs``, ``LambdaLR``'s ``lr_lambdas``) and
    fails on the next step when a group comes without one; the new group gets the first
    group's.
    """
    optimizer = trainer.optimizers[0]
    new = {id(p) for p in params}
    for group in optimizer.param_groups:  # a model swapped before `configure_optimizers` ran
        group["params"] = [p for p in group["params"] if id(p) not in new]
    optimizer.add_param_group({"params": params})
    group = optimizer.param_groups[-1]
    group.setdefault("initial_lr", group["lr"])
    for config in trainer.lr_scheduler_configs:
        scheduler = config.scheduler
        if getattr(scheduler, "optimizer", None) is not optimizer:
            continue
        for name in ("base_lrs", "lr_lambdas", "_last_lr"):
            entries = getattr(scheduler, name, None)
            if isinstance(entries, list) and len(entries) == len(optimizer.param_groups) - 1:
                entries.append(group["initial_lr"] if name == "base_lrs" else entries[0])


def swapped_in(checkpoint: Mapping[str, Any]) -> bool:
    """Whether the checkpoint's run had its model swapped to pre-LN by the ``auto`` policy."""
    states = checkpoint.get("callbacks")
    for state in states.values() if isinstance(states, Mapping) else ():
        auto = state.get("auto") if isinstance(state, Mapping) else None
        applied = auto.get("applied") if isinstance(auto, Mapping) else None
        if isinstance(applied, Mapping) and float(applied.get("swap_to_pre_ln", 0)) > 0:
            return True
    return False


def restore_pre_ln(model: nn.Module, checkpoint: Mapping[str, Any]) -> SwapReport:
    """Apply the checkpoint's recorded ``swap_to_pre_ln`` to ``model`` (a no-op otherwise).

    Call it before the weights load (in ``on_load_checkpoint``); idempotent.

    Returns:
        What the swap changed; its ``new_parameters`` are not in any optimizer yet.
    """
    return swap_to_pre_ln(model) if swapped_in(checkpoint) else SwapReport()


def watch_checkpoint_loads(
    pl_module: pl.LightningModule, restored: Callable[[SwapReport], None]
) -> None:
    """Make ``pl_module.on_load_checkpoint`` call `restore_pre_ln` first (on this instance).

    Args:
        pl_module: The model a Trainer may restore from ``ckpt_path``.
        restored: Called with what the swap changed (to add the new parameters to the
            optimizer once it exists).
    """
    original = pl_module.on_load_checkpoint
    if getattr(original, "restores_pre_ln", False):
        return

    def on_load_checkpoint(checkpoint: dict[str, Any]) -> None:
        report = restore_pre_ln(pl_module, checkpoint)
        if report.changed:
            restored(report)
        original(checkpoint)

    on_load_checkpoint.restores_pre_ln = True  # type: ignore[attr-defined]
    pl_module.on_load_checkpoint = on_load_checkpoint  # type: ignore[method-assign]
