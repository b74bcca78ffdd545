"""Checkpoints of a run that `auto` moved to pre-LN load back into the model it became.

``swap_to_pre_ln`` changes the model: the blocks' norm placement (not in the state dict) and,
for an ``nn.TransformerEncoder``/``Decoder`` without a final norm, a new ``<stack>.norm``
(``Unexpected key(s) in state_dict: "encoder.norm.weight"`` when loaded into a fresh model).
The monitor's state in the checkpoint records that the model was swapped
(``swapped_to_pre_ln``, whatever the policy of the run that saved it); a fresh model gets the
same swap before its weights load:

- ``Trainer(callbacks=[StabilityMonitor(...)]).fit(model, ckpt_path=...)`` under any policy
  (and ``validate``/``test``/``predict`` with the monitor): the monitor does it
  (`stabilizer.callbacks.monitor`), and adds the new norm's parameters to the optimizer as the
  original run did, so that the optimizer state loads too;
- ``MyModule.load_from_checkpoint(path)``, where the module's hyperparameters say its norm
  placement (``norm_first=False``, ``norm_position="post"``, at the top or in a config dict):
  the checkpoint's hyperparameters are saved as pre-LN (`pre_ln_hparams`), so the module is
  built as the model it became;
- any other module: Lightning calls its ``on_load_checkpoint`` first; call `restore_pre_ln`
  there (the reference ``LitGPT`` does)::

      def on_load_checkpoint(self, checkpoint):
          restore_pre_ln(self, checkpoint)

  Without it, a swap that added a norm fails to load with the message above (never a silent
  post-LN model); one that added none loads as post-LN: see docs/remedies.md.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from torch import nn

from stabilizer.core.remedies import SWAP_TO_PRE_LN
from stabilizer.live.remedies import swap_to_pre_ln
from stabilizer.live.remedies.swap_to_pre_ln import SwapReport

from .host import Host

__all__ = [
    "SWAPPED",
    "add_param_group",
    "pre_ln_hparams",
    "restore_pre_ln",
    "swapped_in",
]

SWAPPED = "swapped_to_pre_ln"
"""The key, in the monitor's checkpoint state, that records a model swapped to pre-LN."""

_SWITCHES = {"norm_first": (False, True), "norm_position": ("post", "pre")}


def add_param_group(host: Host, params: list[nn.Parameter]) -> None:
    """Add ``params`` to the first optimizer as a new group, and the group to its schedulers.

    Parameters already in a group (a model swapped while loading, before the optimizer was
    made) move to the new group, as the checkpoint's optimizer state has them. A scheduler keeps
    one entry per group (``base_lrs``, ``LambdaLR``'s ``lr_lambdas``) and
    fails on the next step when a group comes without one; the new group gets the first
    group's.
    """
    optimizer = host.optimizers[0]
    new = {id(p) for p in params}
    for group in optimizer.param_groups:  # a model swapped before `configure_optimizers` ran
        group["params"] = [p for p in group["params"] if id(p) not in new]
    optimizer.add_param_group({"params": params})
    group = optimizer.param_groups[-1]
    group.setdefault("initial_lr", group["lr"])
    for scheduler in host.schedulers:
        if getattr(scheduler, "optimizer", None) is not optimizer:
            continue
        for name in ("base_lrs", "lr_lambdas", "_last_lr"):
            entries = getattr(scheduler, name, None)
            if isinstance(entries, list) and len(entries) == len(optimizer.param_groups) - 1:
                entries.append(group["initial_lr"] if name == "base_lrs" else entries[0])


def swapped_in(checkpoint: Mapping[str, Any]) -> bool:
    """Whether the checkpoint's model had been swapped to pre-LN by the ``auto`` policy (in
    its run, or in a run it was resumed from)."""
    states = checkpoint.get("callbacks")
    for state in states.values() if isinstance(states, Mapping) else ():
        if not isinstance(state, Mapping):
            continue
        auto = state.get("auto")
        applied = auto.get("applied") if isinstance(auto, Mapping) else None
        if state.get(SWAPPED) or (
            isinstance(applied, Mapping) and float(applied.get(SWAP_TO_PRE_LN, 0)) > 0
        ):
            return True
    return False


def pre_ln_hparams(hparams: MutableMapping[str, Any]) -> bool:
    """Say pre-LN in the hyperparameters that say the norm placement (``norm_first=False`` ->
    True, ``norm_position="post"`` -> ``"pre"``, at the top or in nested dicts, as
    ``save_hyperparameters`` keeps a config); True when one was found. In place."""
    found = False
    for key, value in hparams.items():
        if key in _SWITCHES and value == _SWITCHES[key][0]:
            hparams[key] = _SWITCHES[key][1]
            found = True
        elif isinstance(value, MutableMapping):
            found = pre_ln_hparams(value) or found
    return found


def restore_pre_ln(model: nn.Module, checkpoint: Mapping[str, Any]) -> SwapReport:
    """Apply the checkpoint's recorded ``swap_to_pre_ln`` to ``model`` (a no-op otherwise).

    Call it before the weights load (in ``on_load_checkpoint``); idempotent.

    Returns:
        What the swap changed; its ``new_parameters`` are not in any optimizer yet.
    """
    return swap_to_pre_ln(model) if swapped_in(checkpoint) else SwapReport()
