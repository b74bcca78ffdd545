"""`swap_to_pre_ln`: move each block's LayerNorms from after the residual addition to before.

Post-LN (2017) normalizes the residual stream after every sublayer, so gradients to early layers
shrink with depth and training needs a long warmup; pre-LN normalizes only the sublayer inputs and
leaves the stream alone. The swap changes the function the model computes: re-arm the LR warmup
afterwards with ``LRMultiplier.warmup``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

__all__ = ["SwapReport", "has_post_ln", "swap_to_pre_ln"]

_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
_STACKS = (nn.TransformerEncoder, nn.TransformerDecoder)


@dataclass(frozen=True)
class SwapReport:
    """What `swap_to_pre_ln` changed: module names (as in ``named_modules()``).

    Attributes:
        blocks: Blocks and Transformer layers switched from post-LN to pre-LN.
        added_norms: Final-norm slots (``<stack>.norm``) that held None and now hold a new
            ``nn.LayerNorm``: a pre-LN stack's output is not normalized otherwise.
        new_parameters: The parameters of those new norms; add them to the optimizer
            (``optimizer.add_param_group({"params": list(report.new_parameters)})``).
    """

    blocks: tuple[str, ...] = ()
    added_norms: tuple[str, ...] = ()
    new_parameters: tuple[nn.Parameter, ...] = field(default=(), compare=False)

    @property
    def changed(self) -> bool:
        """Whether anything was changed."""
        return bool(self.blocks or self.added_norms)


def has_post_ln(model: nn.Module) -> bool:
    """Whether `model` holds a block or Transformer layer that `swap_to_pre_ln` would switch."""
    return any(_post_ln(module) for module in model.modules())


def _post_ln(module: nn.Module) -> bool:
    if isinstance(module, _LAYERS):
        return not module.norm_first
    return getattr(module, "norm_position", None) == "post"  # the reference Block


def _swap(module: nn.Module) -> bool:
    """Switch one block or Transformer layer to pre-LN; True when it was post-LN."""
    if not _post_ln(module):
        return False
    if isinstance(module, _LAYERS):
        module.norm_first = True
    else:  # the reference Block reads it each forward
        module.norm_position = "pre"  # type: ignore[assignment]
    return True


def _final_norm(stack: nn.TransformerEncoder | nn.TransformerDecoder) -> nn.LayerNorm:
    """A new identity-initialized final norm shaped, placed and typed like the layers' norms."""
    last = stack.layers[-1].norm1
    weight = last.weight
    return nn.LayerNorm(
        last.normalized_shape,
        eps=last.eps,
        bias=last.bias is not None,
        device=None if weight is None else weight.device,
        dtype=None if weight is None else weight.dtype,
    )


def swap_to_pre_ln(model: nn.Module) -> SwapReport:
    """Switch every post-LN block of `model` to pre-LN, keeping its parameters.

    Switches the reference ``Block.norm_position`` (any module whose ``norm_position`` is
    ``"post"``), after which ``GPT.final_norm`` turns ``ln_f`` on, and the ``norm_first`` flag of
    ``nn.TransformerEncoderLayer``/``nn.TransformerDecoderLayer``. An ``nn.TransformerEncoder``/
    ``Decoder`` with a swapped layer and no final norm (``norm is None``) gets a new
    ``nn.LayerNorm`` there, reported in ``new_parameters``; every existing Parameter object stays.
    Such an encoder also stops using nested tensors, as one built with ``norm_first=True`` does.

    Idempotent; a model with no post-LN block is left as it is.

    Args:
        model: Any module; changed in place.
    """
    blocks = [name for name, module in model.named_modules() if _swap(module)]
    added: list[str] = []
    new_parameters: list[nn.Parameter] = []
    swapped = set(blocks)
    for name, stack in model.named_modules():
        if not isinstance(stack, _STACKS) or not stack.layers:
            continue
        prefix = f"{name}.layers." if name else "layers."
        if not any(block.startswith(prefix) for block in swapped):
            continue
        if isinstance(stack, nn.TransformerEncoder):
            stack.use_nested_tensor = False
        if stack.norm is None:
            stack.norm = _final_norm(stack)
            added.append(f"{name}.norm" if name else "norm")
            new_parameters.extend(stack.norm.parameters())
    return SwapReport(tuple(blocks), tuple(added), tuple(new_parameters))
