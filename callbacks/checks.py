"""The Lightning side of the one-off checks: preflight at the first batch, root cause on a NaN.

Both read what they need from the Trainer and hand plain tensors and modules to the torch-only
`stabilizer.live.preflight` and `stabilizer.live.rootcause`. Neither runs in steady state.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import torch

from stabilizer.core.records import Finding, Severity
from stabilizer.live.preflight import (
    causal_by_design,
    causal_self_check,
    config_risks,
    preflight_switches,
)
from stabilizer.live.rootcause import Localization, RngState, locate_nonfinite

__all__ = ["causal_check", "config_checks", "first_token_batch", "root_cause", "target_batch"]

log = logging.getLogger("stabilizer")

_POSITION_ATTRS = ("block_size", "max_position_embeddings", "n_positions", "max_seq_len")
_TARGET_KEYS = ("labels", "label_ids", "lm_labels", "targets", "target", "y")


def config_checks(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    batch: Any,
    switches: Mapping[str, bool] | None = None,
) -> list[Finding]:
    """`config_risk` findings from the Trainer's settings and the model.

    Args:
        trainer: The Trainer.
        pl_module: The model.
        batch: The first training batch.
        switches: Which checks run (see `stabilizer.live.preflight.preflight_switches`).
    """
    on = preflight_switches(True if switches is None else switches)
    ids = first_token_batch(batch)
    return config_risks(
        pl_module,
        warmup_steps=_warmup(trainer),
        precision=str(trainer.precision),
        gradient_clip_val=trainer.gradient_clip_val,
        seq_len=None if ids is None else ids.size(1),
        max_positions=_max_positions(pl_module),
        step=trainer.global_step,
        checks=[name for name, wanted in on.items() if wanted],
    )


def causal_check(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    batch: Any,
    switches: Mapping[str, bool] | None = None,
) -> list[Finding]:
    """The causal self-check on the first batch's token ids (when it is switched on and the batch
    has token ids); a model bidirectional by design gets an `info`, not a critical."""
    on = preflight_switches(True if switches is None else switches)
    ids = first_token_batch(batch)
    if not on["causal"] or ids is None or ids.size(1) < 2:
        return []
    bidirectional = causal_by_design(ids, target_batch(batch, ids)) is False
    return causal_self_check(
        pl_module, ids[:2], step=trainer.global_step, bidirectional=bidirectional
    )


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


def _warmup(trainer: pl.Trainer) -> int | None:
    """0 when the scheduler starts at its peak LR (no warmup), 1 when below it, None: unknown."""
    if not trainer.lr_scheduler_configs or not trainer.optimizers:
        return 0  # a constant LR has no warmup
    group = trainer.optimizers[0].param_groups[0]
    peak = group.get("initial_lr")
    if peak is None or not peak:
        return None
    return 0 if group["lr"] >= 0.5 * peak else 1


def _max_positions(pl_module: pl.LightningModule) -> int | None:
    for owner in (pl_module, getattr(pl_module, "model", None)):
        config = getattr(owner, "config", None)
        for attr in _POSITION_ATTRS:
            value = getattr(config, attr, None)
            if isinstance(value, int):
                return value
    return None


def root_cause(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    batch: Any,
    batch_idx: int,
    rng: RngState | None,
    strict: bool = False,
) -> Finding | None:
    """Replay the failing step (same weights, same batch, same RNG) and name the module.

    None when the replay itself failed (warned; raised when `strict`). Under DDP every rank
    still joins the all-gather of the answers, failed or not, so that none waits forever.
    """
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    scale = float(scaler.get_scale()) if scaler is not None else 1.0

    def run_step() -> torch.Tensor:
        with trainer.precision_plugin.train_step_context(), _quiet(pl_module):
            out = pl_module.training_step(batch, batch_idx)
        loss = out["loss"] if isinstance(out, dict) else out
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"training_step returned {type(out).__name__}, not a loss")
        return loss

    # Under DDP the replay's backward must not all-reduce: the other ranks are not replaying in
    # step (a rank whose forward is already non-finite skips the backward).
    no_sync = getattr(trainer.strategy.model, "no_sync", contextlib.nullcontext)
    where: Localization | None = None
    try:
        with no_sync():
            where = locate_nonfinite(pl_module, run_step, rng_state=rng, loss_scale=scale)
    except Exception as e:
        if strict:
            raise
        log.warning("StabilityMonitor: root-cause replay failed: %r", e)
    rank = trainer.global_rank
    if trainer.world_size > 1 and torch.distributed.is_initialized():
        # The fault may sit on one rank only: every rank gets every rank's answer (our own
        # processes' objects, pickled by torch.distributed) and reports the first reproduced.
        gathered: list[Localization | None] = [None] * trainer.world_size
        torch.distributed.all_gather_object(gathered, where)
        answers = [(r, w) for r, w in enumerate(gathered) if w is not None]
        reproduced = [(r, w) for r, w in answers if w.reproduced]
        if reproduced or answers:
            rank, where = (reproduced or answers)[0]
    if where is None:
        return None
    finding = _finding(trainer.global_step, where)
    if trainer.world_size > 1:
        finding = replace(finding, message=f"rank {rank}: {finding.message}")
    return finding


def _finding(step: int, where: Localization) -> Finding:
    # Names are relative to the LightningModule, in the location and in the message alike.
    module = None if where.module is None else _strip(where.module)
    parameter = None if where.parameter is None else _strip(where.parameter)
    where = replace(where, module=module, parameter=parameter)
    location = (module,) if module else ()
    severity = Severity.ERROR if where.reproduced else Severity.WARNING
    message = where.message
    if where.reproduced:  # (a NaN made by the loss code alone is no numerical fault of a module)
        what = "deterministic" if where.phase == "loss" else "a numerical fault"
        message += f" (reproduced on replay: {what}; replay {where.elapsed_s:.2f} s)"
    # fp32 islands help a module that overflows, not a NaN made in the loss computation.
    numerical = where.reproduced and where.phase != "loss"
    remedies = ("upcast_to_fp32", "skip_step") if numerical else ("skip_step",)
    return Finding("root_cause", step, step, severity, message, where.evidence, location, remedies)


def _strip(name: str) -> str:
    # Names are relative to the LightningModule: drop the wrapper's attribute (``model.``).
    return name.removeprefix("model.")


@contextlib.contextmanager
def _quiet(pl_module: pl.LightningModule) -> Iterator[None]:
    """No ``self.log`` from a replayed training step: its numbers were logged once already."""
    saved = pl_module.__dict__.get("log"), pl_module.__dict__.get("log_dict")
    pl_module.log = pl_module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        for name, value in zip(("log", "log_dict"), saved, strict=True):
            if value is None:
                pl_module.__dict__.pop(name, None)
            else:
                setattr(pl_module, name, value)
