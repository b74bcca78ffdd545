"""The Lightning side of the one-off checks: preflight at the first batch, root cause on a NaN.

Both read what they need from the Trainer and hand plain tensors and modules to the torch-only
`stabilizer.live.preflight` and `stabilizer.live.rootcause`. Neither runs in steady state.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch

from stabilizer.core.kinds import IN_THE_LOSS, ROOT_CAUSE
from stabilizer.core.records import Finding, Severity
from stabilizer.live.held import HeldNonFinite
from stabilizer.live.preflight import (
    causal_by_design,
    causal_self_check,
    config_risks,
    optimizer_risks,
    preflight_switches,
)
from stabilizer.live.rootcause import Localization, locate_nonfinite
from stabilizer.live.sandbox import Sandboxed, sandbox

if TYPE_CHECKING:
    from .guard import StepGuard
    from .live_step import MicroBatch

__all__ = [
    "Preflight",
    "causal_check",
    "config_checks",
    "first_token_batch",
    "preflight",
    "root_cause",
    "target_batch",
]

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
    risky = optimizer_risks(trainer.optimizers, trainer.global_step) if on["optimizer_eps"] else []
    return risky + config_risks(
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


def preflight(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    batch: Any,
    switches: Mapping[str, bool],
    quiet: Callable[[], AbstractContextManager[None]],
    guard: StepGuard | None,
    strict: bool,
) -> list[Finding]:
    """The preflight at the first batch: the configuration checks, the causal self-check.

    Each runs the model in a sandbox (nothing stays) with the optimizers inert and the monitor's
    hooks `quiet`; a model a check cannot run on (a forward that wants more than token ids) loses
    that check, not the others, nor the monitor.
    """
    found: list[Finding] = []
    for check, what in ((config_checks, "config checks"), (causal_check, "causal self-check")):
        try:
            with quiet(), sandbox(pl_module), guard.inert() if guard else nullcontext():
                found += check(trainer, pl_module, batch, switches)
        except Exception as e:
            if strict:
                raise
            if trainer.is_global_zero:
                log.warning("StabilityMonitor: preflight %s skipped: %r", what, e)
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
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        quiet: Callable[[], AbstractContextManager[None]],
        guard: StepGuard | None,
    ) -> list[Finding]:
        """`preflight`'s findings the first time; nothing after."""
        if self.done:
            return []
        self.done = True
        return preflight(trainer, pl_module, batch, self.switches, quiet, guard, self.strict)


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
    micro: Sequence[MicroBatch],
    loss_scale: float,
    guard: StepGuard | None,
    step: int,
    strict: bool = False,
    quiet: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
    held: HeldNonFinite | None = None,
) -> Finding | None:
    """Replay the failing step's micro-batches (same weights, same batches, same RNG) in a
    sandbox and name the module; the first micro-batch that reproduces the fault is reported.

    Micro-batches whose loss was non-finite are replayed first, then the others in order. No
    optimizer can step inside (the guard is inert, ``self.optimizers()`` hands out inert
    stand-ins, ``manual_backward`` only backpropagates); gradients, buffers, RNG and the modules'
    attributes are put back; `quiet` keeps the monitor's own hooks out of it. None when the
    replay itself failed (warned; raised when `strict`).
    Under DDP every rank joins the all-gather of the answers, failed or not, so none waits.
    """
    where: Localization | None = None
    index = 0
    try:
        with quiet(), _replaying(pl_module, guard) as box:
            for index in _replay_order(micro):
                run = _step_runner(trainer, pl_module, micro[index], loss_scale)
                rng = micro[index].rng
                where = locate_nonfinite(
                    pl_module, run, rng_state=rng, loss_scale=loss_scale,
                    inputs=micro[index].batch, held=held,
                )  # fmt: skip
                if where.reproduced:
                    break
        if box.changed:
            log.warning("StabilityMonitor: the replay wrote parameters in place: %s", box.changed)
    except Exception as e:
        if strict:
            raise
        log.warning("StabilityMonitor: root-cause replay failed: %r", e)
        where = None
    rank, where, index = _gather(trainer, where, index)
    if where is None:
        return None
    finding = _finding(step, where)
    prefix = f"micro-batch {index + 1} of {len(micro)}: " if len(micro) > 1 else ""
    if trainer.world_size > 1 and where.reproduced:
        prefix = f"rank {rank}: {prefix}"
    return replace(finding, seen=prefix + finding.seen) if prefix else finding


def _replay_order(micro: Sequence[MicroBatch]) -> list[int]:
    """Micro-batches with a non-finite loss first (read now: a failing step only)."""
    bad = [
        i for i, m in enumerate(micro)
        if any(not bool(torch.isfinite(loss).all()) for loss in m.losses)
    ]  # fmt: skip
    return bad + [i for i in range(len(micro)) if i not in bad]


def _gather(
    trainer: pl.Trainer, where: Localization | None, index: int
) -> tuple[int, Localization | None, int]:
    """Under DDP, every rank's answer; the first that reproduced the fault wins."""
    rank = trainer.global_rank
    if trainer.world_size > 1 and torch.distributed.is_initialized():
        # The fault may sit on one rank only (our own processes' objects, pickled by
        # torch.distributed, never a log's).
        gathered: list[tuple[Localization | None, int] | None] = [None] * trainer.world_size
        torch.distributed.all_gather_object(gathered, (where, index))
        answers = [(r, a[0], a[1]) for r, a in enumerate(gathered) if a and a[0] is not None]
        reproduced = [a for a in answers if a[1] is not None and a[1].reproduced]
        if reproduced or answers:
            return (reproduced or answers)[0]
    return rank, where, index


def _step_runner(
    trainer: pl.Trainer, pl_module: pl.LightningModule, micro: MicroBatch, scale: float
) -> Callable[[], torch.Tensor]:
    """The micro-batch's training step as `locate_nonfinite` replays it. Under manual
    optimization the step backpropagates itself (its loss comes back detached)."""

    def run_step() -> torch.Tensor:
        backwarded: list[torch.Tensor] = []

        def manual_backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            backwarded.append(loss)
            torch.autograd.backward(loss * scale, *args, **kwargs)

        pl_module.manual_backward = manual_backward  # type: ignore[method-assign]
        with trainer.precision_plugin.train_step_context():
            out = pl_module.training_step(micro.batch, micro.index)
        if backwarded:
            return backwarded[-1].detach()
        loss = out["loss"] if isinstance(out, dict) else out
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"training_step returned {type(out).__name__}, not a loss")
        return loss

    return run_step


@contextlib.contextmanager
def _replaying(pl_module: pl.LightningModule, guard: StepGuard | None) -> Iterator[Sandboxed]:
    """The sandbox of a replay: nothing it does stays, no optimizer steps, nothing is logged.

    Under DDP the replay's backward must not all-reduce: the other ranks are not replaying in
    step (a rank whose forward is already non-finite skips the backward).
    """
    trainer = pl_module.trainer
    no_sync = getattr(trainer.strategy.model, "no_sync", contextlib.nullcontext)
    optimizers = _inert(pl_module.optimizers(use_pl_optimizer=False))
    schedulers = pl_module.lr_schedulers()
    with (
        sandbox(pl_module) as box,
        guard.inert() if guard is not None else contextlib.nullcontext(),
        no_sync(),
    ):
        # Instance attributes, undone by the sandbox: the step's own calls find stand-ins.
        pl_module.optimizers = lambda use_pl_optimizer=True: optimizers  # type: ignore[method-assign]
        pl_module.lr_schedulers = lambda: _inert(schedulers)  # type: ignore[method-assign]
        pl_module.log = pl_module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign,assignment]
        yield box


class _Inert:
    """An optimizer or scheduler whose ``step`` and ``zero_grad`` do nothing; the rest is the
    real one's (param groups, state)."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _inert(objs: Any) -> Any:
    if objs is None:
        return None
    if isinstance(objs, list | tuple):
        return [_Inert(o) for o in objs]
    return _Inert(objs)


def _finding(step: int, where: Localization) -> Finding:
    # Names are relative to the LightningModule, in the location and in the message alike.
    module = None if where.module is None else _strip(where.module)
    parameter = None if where.parameter is None else _strip(where.parameter)
    where = replace(where, module=module, parameter=parameter)
    location = (module,) if module else ()
    severity = Severity.ERROR if where.reproduced else Severity.WARNING
    seen, evidence = where.message, where.evidence
    if where.reproduced:  # (a NaN made by the loss code alone is no numerical fault of a module)
        what = "deterministic" if where.phase == "loss" else "a numerical fault"
        seen += f" (reproduced on replay: {what}; replay {where.elapsed_s:.2f} s)"
    if where.reproduced and where.phase == "loss":
        evidence[IN_THE_LOSS] = 1.0
    # fp32 islands help a module that overflows, not a NaN made in the loss computation.
    numerical = where.reproduced and where.phase != "loss"
    return Finding(
        kind=ROOT_CAUSE, step=step, end_step=step, severity=severity, seen=seen,
        evidence=evidence, location=location,
        remedies=("upcast_to_fp32", "skip_step") if numerical else ("skip_step",),
    )  # fmt: skip


def _strip(name: str) -> str:
    # Names are relative to the LightningModule: drop the wrapper's attribute (``model.``).
    return name.removeprefix("model.")
