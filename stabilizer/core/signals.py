"""Signal keys: the names of the numbers in a `StepRecord`, defined once.

Every producer (the live probes, the log readers) and every consumer (the detectors, the reports)
spells a signal through these constants. A key that ends in ``/`` is a prefix: the full key appends
a depth group (``grad_norm/block_03``) or a module name (``act_absmax/blocks.3.mlp``).

Depth groups are ``embed``, ``block_00`` .. ``block_NN``, ``head`` and ``other``. Block numbers are
zero-padded to at least two digits (three from 100 layers on) so that TensorBoard, which sorts tags
as text, lists them in depth order.
"""

from __future__ import annotations

import re

__all__ = [
    "ACT_ABSMAX_PREFIX",
    "CLIPPED",
    "CLIP_VAL",
    "EMBED",
    "GRAD_NORM",
    "GRAD_NORM_LOG10_PREFIX",
    "GRAD_NORM_PREFIX",
    "HEAD",
    "LOSS",
    "LOSS_SCALE",
    "LR",
    "NEW_DATA",
    "NONFINITE_GRADS",
    "NONFINITE_UPDATE",
    "NONFINITE_WEIGHTS",
    "OTHER",
    "PPL",
    "SKIPPED",
    "SO_FAR_PREFIX",
    "TB_PREFIX",
    "UPDATE_RATIO_PREFIX",
    "VIEWS",
    "VOCAB_SIZE",
    "block_group",
    "block_index",
    "group_key",
    "strip_prefix",
]

LOSS = "loss"  # training loss of the step (mean over the batch), as the optimizer saw it
GRAD_NORM = "grad_norm"  # total L2 norm of all gradients: unscaled (AMP), before clipping
GRAD_NORM_PREFIX = "grad_norm/"  # + depth group: L2 norm of that group's gradients, as GRAD_NORM
UPDATE_RATIO_PREFIX = "update_ratio/"  # + depth group: ‖Δw‖ / ‖w‖ of that group's optimizer step
NONFINITE_GRADS = "nonfinite_grads"  # number of parameters whose gradient holds a NaN or an Inf
NONFINITE_UPDATE = "nonfinite_update"  # 1.0 when the optimizer made finite weights non-finite
# Live only: how many of the parameters, optimizer-state tensors and buffers the step would update
# held a NaN/Inf before it (the check that the previous update left them finite)
NONFINITE_WEIGHTS = "nonfinite_weights"
LOSS_SCALE = "loss_scale"  # dynamic loss scale of the fp16 grad scaler (absent without one)
SKIPPED = "skipped"  # 1.0 when the optimizer step was skipped (grad scaler, guard), else 0.0
CLIPPED = "clipped"  # 1.0 when gradient clipping changed the gradients this step, else 0.0
CLIP_VAL = "clip_val"  # the gradient clipping threshold in force (absent when clipping is off)
LR = "lr"  # learning rate of the first parameter group, after the scheduler
# 1.0 on the first step drawn from a training dataloader the run had not used before (a new
# stage); live only. A jump of the loss there is the run's own doing, not a divergence (LossSpike)
NEW_DATA = "new_data"
VOCAB_SIZE = "vocab_size"  # the vocabulary (or class count) a log states: chance level is ln of it
PPL = "ppl"  # a perplexity a log prints: exp of its per-token loss (the loss where none is)
ACT_ABSMAX_PREFIX = "act_absmax/"  # + module name: max |output activation|; sampled steps only

TB_PREFIX = "stability/"  # loggers write every key under this prefix; readers strip it
# + depth group: log10 of grad_norm/<group>, for TensorBoard's linear charts; a view, not a
# signal: the readers drop it
GRAD_NORM_LOG10_PREFIX = "grad_norm_log10/"
# + ``skipped`` or ``clipped``: how many steps so far, for TensorBoard's chart of them (a 0/1
# signal that is mostly 0 lies flat under its default "ignore outliers"); a view, not a signal
SO_FAR_PREFIX = "so_far/"
VIEWS = (GRAD_NORM_LOG10_PREFIX, SO_FAR_PREFIX)
"""Prefixes of the keys written for TensorBoard's charts only: the readers drop them."""

EMBED = "embed"  # depth group: token and position embeddings
HEAD = "head"  # depth group: final norm and output projection
OTHER = "other"  # depth group: anything that matches no convention

_BLOCK = re.compile(r"block_(\d+)")


def group_key(group: str, prefix: str = GRAD_NORM_PREFIX) -> str:
    """The signal key of a depth group: ``group_key("block_03")`` is ``"grad_norm/block_03"``.

    Args:
        group: A depth group name (``embed``, ``block_03``, ``head``, ``other``).
        prefix: The signal prefix, ``GRAD_NORM_PREFIX`` or ``UPDATE_RATIO_PREFIX``.
    """
    return prefix + group


def block_group(index: int, n_layers: int | None = None) -> str:
    """The depth group name of block ``index``: ``block_group(7, 12)`` is ``"block_07"``.

    Args:
        index: Zero-based block index.
        n_layers: Number of blocks in the stack; from 100 on, names get three digits (and so on).
            Without it the width is two digits or more if ``index`` needs them.

    Raises:
        ValueError: ``index`` is negative or not below ``n_layers``.
    """
    if index < 0:
        raise ValueError(f"`index` must be >= 0, got {index}")
    if n_layers is not None and index >= n_layers:
        raise ValueError(f"`index` must be < n_layers ({n_layers}), got {index}")
    width = max(2, len(str(n_layers if n_layers is not None else index)))
    return f"block_{index:0{width}d}"


def block_index(group: str) -> int | None:
    """The block index of a group name, or None: ``block_index("block_07")`` is 7.

    A full key works too: everything up to the last ``/`` is ignored, so
    ``block_index("grad_norm/block_07")`` is 7 and ``block_index("embed")`` is None.
    """
    match = _BLOCK.fullmatch(group.rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def strip_prefix(tag: str) -> str:
    """A logged tag without the ``stability/`` prefix: ``"stability/loss"`` becomes ``"loss"``."""
    return tag[len(TB_PREFIX) :] if tag.startswith(TB_PREFIX) else tag
