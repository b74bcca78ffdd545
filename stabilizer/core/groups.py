"""Depth groups: which part of the stack a parameter belongs to, from its name alone.

Per-group gradient norms (``grad_norm/block_03``) let a detector see a band of starving layers at
one end of the stack. The grouping is a plain function of parameter names, so a user with an
unusual model can pass their own function with the same signature.

Recognised conventions (any prefix such as ``module.``, ``_orig_mod.`` or ``model.`` is fine):

- blocks: ``blocks.N.`` (nanoGPT, timm), ``layers.N.`` (Llama, ``nn.TransformerEncoder``), ``h.N.``
  (GPT-2), ``layer.N.`` (BERT), ``block.N.`` (T5); ``transformer.h.N.``, ``model.layers.N.``,
  ``gpt_neox.layers.N.``, ``encoder.layers.N.``, ``decoder.layers.N.`` are special cases. An
  encoder and a decoder stack share block numbers.
- ``embed``: ``wte``, ``wpe``, ``emb``, ``tok``, ``pos``, ``embed_tokens``, ``embed_positions``,
  ``embeddings``, ``embedding``, ``embed_in``, any name part containing ``embed``, and any that
  starts with ``emb_`` or ends with ``_emb`` (``tok_emb``, ``pos_emb``).
- ``head``: ``lm_head``, ``head``, ``output``, ``embed_out``, ``unembed`` and the final norm
  (``ln_f``, ``norm``, ``final_layer_norm``, ``final_layernorm``, ``final_norm``, ``ln_final``,
  ``norm_f``, and a plain ``ln`` outside the blocks: only the final norm sits there).
- ``other``: everything else. Its place in the stack is unknown, so pictures draw it apart from
  the stack, never as its output end.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from .signals import EMBED, HEAD, OTHER, block_group, block_index

__all__ = ["depth_group", "group_params"]

_BLOCK = re.compile(r"(?:^|\.)(?:blocks|layers|layer|block|h)\.(\d+)(?:\.|$)")
_HEAD_PARTS = frozenset(
    {
        "lm_head",
        "head",
        "output",
        "embed_out",
        "unembed",
        "ln_f",
        "norm",
        "final_layer_norm",
        "final_layernorm",
        "final_norm",
        "ln_final",
        "norm_f",
        "ln",
    }
)
_EMBED_PARTS = frozenset({"wte", "wpe", "emb", "tok", "pos"})


def _is_embed(part: str) -> bool:
    return (
        part in _EMBED_PARTS or "embed" in part or part.endswith("_emb") or part.startswith("emb_")
    )


def depth_group(param_name: str, n_layers: int | None = None) -> str:
    """The depth group of one parameter.

    Args:
        param_name: A name from ``named_parameters()``, e.g. ``"transformer.h.3.mlp.c_fc.weight"``.
        n_layers: Number of blocks, for the zero-padding of block names (see ``block_group``).

    Returns:
        ``"embed"``, ``"block_NN"``, ``"head"`` or ``"other"``.

    Raises:
        ValueError: The block index is not below ``n_layers``.
    """
    match = _BLOCK.search(param_name)
    if match:
        return block_group(int(match.group(1)), n_layers)
    # The outermost recognised part decides: "embeddings.LayerNorm" is embed, "model.norm" is head.
    for part in param_name.split("."):
        if part in _HEAD_PARTS:
            return HEAD
        if _is_embed(part):
            return EMBED
    return OTHER


def group_params(names: Iterable[str]) -> dict[str, list[str]]:
    """Parameter names grouped by depth: embed, the blocks in depth order, head, other.

    Only groups that hold a parameter appear. Block names are padded for the deepest block found.

    Args:
        names: Parameter names, e.g. ``(n for n, _ in model.named_parameters())``.
    """
    names = list(names)
    indices = [int(m.group(1)) for m in map(_BLOCK.search, names) if m]
    n_layers = max(indices) + 1 if indices else None
    grouped: dict[str, list[str]] = {}
    for name in names:
        grouped.setdefault(depth_group(name, n_layers), []).append(name)

    def order(group: str) -> tuple[int, int]:
        index = block_index(group)
        if index is not None:
            return (1, index)
        return ({EMBED: 0, HEAD: 2}.get(group, 3), 0)

    return {group: grouped[group] for group in sorted(grouped, key=order)}
