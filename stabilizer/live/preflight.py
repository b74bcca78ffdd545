"""Preflight: checks run once at fit start, before a step is spent on a run that cannot go well.

`causal_self_check` runs the model twice on one batch; `config_risks` only reads the model and
the run's settings. Both return `stabilizer.core.records.Finding` lists (kinds ``causal_leak`` and
``config_risk``) and know nothing of Lightning: the callback gathers the arguments.

Each check has a name (`PREFLIGHT_CHECKS`) and can be switched off alone (`preflight_switches`).
Whether a model is *meant* to be causal is read from its training batch (`causal_by_design`): a
masked-LM batch, whose targets are not the inputs shifted by one, belongs to a model that sees
the whole sequence by design, and its "leak" is no fault.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from stabilizer.core.kinds import CAUSAL_LEAK, CONFIG_RISK
from stabilizer.core.records import Finding, Severity
from stabilizer.core.remedies import CLIP_GRADIENTS, LR_WARMUP, SWAP_TO_PRE_LN, UPCAST_TO_FP32

__all__ = [
    "IGNORE_INDEX",
    "PREFLIGHT_CHECKS",
    "causal_by_design",
    "causal_self_check",
    "config_risks",
    "optimizer_risks",
    "preflight_switches",
]

logger = logging.getLogger(__name__)

LEAK_CONSEQUENCE = "training loss will look excellent and generation will fail"

PREFLIGHT_CHECKS = (
    "causal",
    "post_ln_warmup",
    "fp16_norms",
    "clipping",
    "positions",
    "optimizer_eps",
)
"""The checks, by name: the causal self-check, then the rules of `config_risks`."""

IGNORE_INDEX = -100  # targets below 0 (PyTorch's and HF's -100) are positions without a loss
_CAUSAL_SHARE = 0.9  # share of the scored targets that must be the next (or same) token

# Relative tolerance per output dtype: the earlier positions run the same kernels on the same
# values, so they agree to rounding (in practice bit for bit).
_RTOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}

_NORMS: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)
_ENCODER_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def preflight_switches(preflight: bool | Mapping[str, bool]) -> dict[str, bool]:
    """Which checks run: ``True`` all, ``False`` none, a mapping switches the checks it names.

    ``preflight_switches({"causal": False})`` runs every check but the causal self-check.

    Raises:
        TypeError: ``preflight`` is neither a bool nor a mapping.
        ValueError: A key is not a check's name (see `PREFLIGHT_CHECKS`).
    """
    if isinstance(preflight, bool):
        return dict.fromkeys(PREFLIGHT_CHECKS, preflight)
    if not isinstance(preflight, Mapping):
        raise TypeError(f"`preflight` must be a bool or a dict, got {type(preflight).__name__}")
    unknown = sorted(set(preflight) - set(PREFLIGHT_CHECKS))
    if unknown:
        names = ", ".join(PREFLIGHT_CHECKS)
        raise ValueError(f"`preflight` keys must be among {names}, got {unknown}")
    return {name: bool(preflight.get(name, True)) for name in PREFLIGHT_CHECKS}


def causal_by_design(input_ids: Tensor, targets: Tensor | None) -> bool | None:
    """Whether a batch trains next-token prediction, as a causal model does.

    True when at least 90% of the scored targets (those >= 0) are the next input token (the
    targets are the inputs shifted by one, as nanoGPT's) or the same token (the model shifts
    inside, as Hugging Face causal LMs do); False otherwise (a masked-LM batch: most targets
    ignored, the rest under mask tokens); None when there are no targets to tell by.

    Args:
        input_ids: Token ids ``(B, T)``.
        targets: The batch's targets, or None.
    """
    if targets is None or targets.shape != input_ids.shape or input_ids.size(-1) < 2:
        return None
    scored = targets >= 0
    if not bool(scored.any()):
        return None
    same = (targets == input_ids)[scored].float().mean()
    ahead = scored[:, :-1]
    shifted = (targets[:, :-1] == input_ids[:, 1:])[ahead].float().mean() if ahead.any() else 0.0
    return max(float(same), float(shifted)) >= _CAUSAL_SHARE


def causal_self_check(
    model: nn.Module,
    input_ids: Tensor,
    forward: Callable[[Tensor], Tensor] | None = None,
    *,
    step: int = 0,
    bidirectional: bool = False,
) -> list[Finding]:
    """Check that no position's output depends on a later token (a leaking causal mask).

    Runs the model on ``input_ids``, changes the last token of every row, runs it again, and
    requires every earlier position's output to be unchanged. Outputs that do not keep the
    inputs' ``(B, T)`` axes followed by features (a sequence classifier's ``(B, classes)``) have
    no positions: the check is skipped. The model runs in eval mode without
    gradients; each module's train/eval mode is restored afterwards.

    Args:
        model: A causal language model.
        input_ids: Token ids ``(B, T)``, ``T >= 2``, on the model's device.
        forward: ``input_ids -> logits (B, T, ...)``; by default ``model(input_ids)``, taking the
            first element of a tuple, the ``"logits"`` of a mapping or the ``.logits`` attribute.
        step: The step the finding is dated to.
        bidirectional: The model sees the whole sequence by design (see `causal_by_design`):
            a leak is reported as info, not as a fault.

    Returns:
        One ``causal_leak`` finding naming the first position that changed (critical; info when
        ``bidirectional``), or nothing.

    Raises:
        ValueError: ``input_ids`` is not ``(B, T)`` with ``T >= 2``.
    """
    if input_ids.dim() != 2 or input_ids.size(1) < 2:
        raise ValueError(
            f"`input_ids` must be (B, T) with T >= 2, got shape {tuple(input_ids.shape)}"
        )
    run = forward if forward is not None else lambda ids: _logits(model(ids))
    changed_ids = input_ids.clone()
    last = changed_ids[:, -1]
    changed_ids[:, -1] = torch.where(last == 0, torch.ones_like(last), torch.zeros_like(last))
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            before, after = run(input_ids), run(changed_ids)
    finally:
        for module, training in modes:
            module.training = training
    if before.dim() < 3 or tuple(before.shape[:2]) != tuple(input_ids.shape):
        # (batch, classes) of a sequence classifier, a pooled embedding: no positions to compare
        logger.info(
            "causal self-check skipped: the outputs %s do not keep the inputs' sequence axis %s",
            tuple(before.shape),
            tuple(input_ids.shape),
        )
        return []
    found = _leak(before, after, step)
    if bidirectional:
        return [_by_design(f) for f in found]
    return found


def _by_design(leak: Finding) -> Finding:
    message = (
        "every position sees the whole sequence, as a bidirectional model does by design: the "
        "batch's targets are not the inputs shifted by one (a masked-LM objective), so no "
        "causal mask is needed; pass preflight={'causal': False} to skip this check"
    )
    return _finding(CAUSAL_LEAK, leak.step, Severity.INFO, message, leak.evidence)


def _logits(out: Any) -> Tensor:
    if isinstance(out, tuple | list):
        out = out[0]
    elif isinstance(out, Mapping):
        out = out["logits"]
    elif hasattr(out, "logits"):
        out = out.logits
    if not isinstance(out, Tensor):
        raise TypeError(f"the model's output must hold a logits tensor, got {type(out).__name__}")
    return out


def _leak(before: Tensor, after: Tensor, step: int) -> list[Finding]:
    T = before.size(1)
    earlier = before[:, :-1].float(), after[:, :-1].float()  # (B, T - 1, ...) each
    if not bool(torch.isfinite(earlier[0]).all()):
        logger.warning("causal self-check skipped: the model's outputs are not finite")
        return []
    diff = (earlier[1] - earlier[0]).abs().transpose(0, 1).reshape(T - 1, -1).amax(1)  # (T - 1,)
    scale = max(1.0, float(earlier[0].abs().amax()))
    moved = (diff > _RTOL.get(before.dtype, 1e-5) * scale).nonzero().flatten().tolist()
    if not moved:
        return []
    first = int(moved[0])
    message = (
        f"changing the last token changed the outputs at position {first} "
        f"({len(moved)} of {T - 1} earlier positions): the model sees future tokens; "
        f"{LEAK_CONSEQUENCE}"
    )
    evidence = {
        "first_position": first,
        "positions_changed": len(moved),
        "seq_len": T,
        "max_abs_diff": float(diff.max()),
    }
    return [_finding(CAUSAL_LEAK, step, Severity.CRITICAL, message, evidence)]


def config_risks(
    model: nn.Module,
    *,
    warmup_steps: int | None,
    precision: str,
    gradient_clip_val: float | None,
    seq_len: int | None,
    max_positions: int | None,
    step: int = 0,
    checks: Collection[str] = PREFLIGHT_CHECKS,
) -> list[Finding]:
    """Settings known to destabilise Transformer training, read before the first step.

    Rules (each ``config_risk``), by check name:

    - ``post_ln_warmup``: trainable post-LN blocks (any module with ``norm_position == "post"``,
      as the reference ``Block``, or PyTorch encoder/decoder layers with ``norm_first=False``)
      and ``warmup_steps == 0``: info (advice: the configuration alone is no failure, and a
      pretrained post-LN model fine-tuned without warmup is common and healthy);
    - ``fp16_norms``: LayerNorm or attention softmax in fp16 (``precision == "16-true"`` or fp16
      parameters): info (advice);
    - ``clipping``: no gradient clipping (``gradient_clip_val`` None or 0): info;
    - ``positions``: ``seq_len > max_positions``: critical.

    Args:
        model: The model about to be trained.
        warmup_steps: Learning-rate warmup steps; None when not known (the post-LN rule is skipped).
        precision: Lightning's precision string (``"32-true"``, ``"16-mixed"``, ``"16-true"``, ...).
        gradient_clip_val: The clipping threshold; None or 0 for none.
        seq_len: Training sequence length; None when not known.
        max_positions: Longest sequence the model has positions for; None when unbounded.
        step: The step the findings are dated to.
        checks: The rules to apply, by name (other names, such as ``causal``, are ignored).

    Raises:
        ValueError: A count or threshold is negative (or a length below 1).
    """
    _check_non_negative(warmup_steps=warmup_steps, gradient_clip_val=gradient_clip_val)
    for name, value in (("seq_len", seq_len), ("max_positions", max_positions)):
        if value is not None and value < 1:
            raise ValueError(f"`{name}` must be >= 1 or None, got {value}")
    found: list[Finding] = []
    if "post_ln_warmup" in checks:
        found += _post_ln_without_warmup(model, warmup_steps, step)
    if "fp16_norms" in checks:
        found += _fp16_norms(model, precision, step)
    if "clipping" in checks:
        found += _no_clipping(gradient_clip_val, step)
    if "positions" in checks:
        found += _too_long(seq_len, max_positions, step)
    return found


def optimizer_risks(optimizers: Sequence[torch.optim.Optimizer], step: int = 0) -> list[Finding]:
    """``optimizer_eps``: an Adam-style optimizer (``betas`` and ``eps`` in a param group) with
    ``eps=0`` divides by ``sqrt(v) = 0`` wherever a gradient element has been exactly 0 since
    the start (an embedding row no batch used): 0/0 = NaN in the weights from finite gradients
    (warning; the guard verifies such steps and undoes a non-finite one)."""
    found = []
    for i, opt in enumerate(optimizers):
        zero = [j for j, g in enumerate(opt.param_groups) if "betas" in g and g.get("eps") == 0]
        if zero:
            message = (
                f"optimizer {i} ({type(opt).__name__}) has eps=0 in param group(s) {zero}: a "
                "gradient element that has always been 0 gives 0/0 = NaN in the weights; use "
                "eps >= 1e-8 (1e-6 or more for fp16 parameters)"
            )
            evidence = {"optimizer": float(i), "eps": 0.0}
            found.append(_finding(CONFIG_RISK, step, Severity.WARNING, message, evidence))
    return found


def _check_non_negative(**values: float | None) -> None:
    for name, value in values.items():
        if value is not None and value < 0:
            raise ValueError(f"`{name}` must be >= 0 or None, got {value}")


def _post_ln_without_warmup(model: nn.Module, warmup_steps: int | None, step: int) -> list[Finding]:
    if warmup_steps != 0:
        return []
    post = tuple(
        name
        for name, m in model.named_modules()
        if (
            getattr(m, "norm_position", None) == "post"  # the reference Block, and alike
            or (isinstance(m, _ENCODER_LAYERS) and not m.norm_first)
        )
        and any(p.requires_grad for p in m.parameters())  # a frozen block is not trained
    )
    if not post:
        return []
    message = (
        f"{len(post)} trainable post-LN blocks and no learning-rate warmup: trained from "
        "scratch, post-LN gradients near the output are large at initialisation and early "
        "steps can diverge; a warmup (or pre-LN) avoids it"
    )
    evidence = {"post_ln_blocks": len(post), "warmup_steps": 0}
    remedies = (LR_WARMUP, SWAP_TO_PRE_LN)
    return [_finding(CONFIG_RISK, step, Severity.INFO, message, evidence, post, remedies)]


def _fp16_norms(model: nn.Module, precision: str, step: int) -> list[Finding]:
    true_fp16 = precision == "16-true"
    norms = [n for n, m in model.named_modules() if isinstance(m, _NORMS) and _fp16(m, true_fp16)]
    softmax = [
        n
        for n, m in model.named_modules()
        if (getattr(m, "softmax_fp32", None) is False and _fp16(m, true_fp16))
        or (isinstance(m, nn.MultiheadAttention) and _fp16(m, true_fp16))
    ]
    if not norms and not softmax:
        return []
    message = (
        f"{len(norms)} LayerNorms and {len(softmax)} attention softmaxes run in fp16 "
        f"(precision {precision!r}): variances and scores overflow above 65504"
    )
    evidence = {"fp16_norms": len(norms), "fp16_softmax": len(softmax)}
    location = (*norms, *softmax)
    remedies = (UPCAST_TO_FP32,)
    return [_finding(CONFIG_RISK, step, Severity.INFO, message, evidence, location, remedies)]


def _fp16(module: nn.Module, true_fp16: bool) -> bool:
    """Whether ``module`` computes in fp16: under "16-true", or with fp16 parameters."""
    return true_fp16 or any(p.dtype == torch.float16 for p in module.parameters())


def _no_clipping(gradient_clip_val: float | None, step: int) -> list[Finding]:
    if gradient_clip_val:
        return []
    message = "no gradient clipping: one bad batch can take a step as large as its gradient"
    evidence = {"gradient_clip_val": 0.0}
    return [_finding(CONFIG_RISK, step, Severity.INFO, message, evidence, (), (CLIP_GRADIENTS,))]


def _too_long(seq_len: int | None, max_positions: int | None, step: int) -> list[Finding]:
    if seq_len is None or max_positions is None or seq_len <= max_positions:
        return []
    message = (
        f"sequence length {seq_len} exceeds the model's {max_positions} positions: "
        "the later positions have no embedding (an index error, or garbage with RoPE tables)"
    )
    evidence = {"seq_len": seq_len, "max_positions": max_positions}
    return [_finding(CONFIG_RISK, step, Severity.CRITICAL, message, evidence)]


def _finding(
    kind: str,
    step: int,
    severity: Severity,
    seen: str,
    evidence: Mapping[str, float],
    location: Sequence[str] = (),
    remedies: tuple[str, ...] = (),
) -> Finding:
    """A finding of the set-up: at the step of the first batch, with no end step."""
    return Finding(
        kind=kind, step=step, end_step=None, severity=severity, seen=seen,
        evidence=evidence, location=tuple(location), remedies=remedies,
    )  # fmt: skip
