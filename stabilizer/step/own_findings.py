"""The monitor's own findings of a step: what no detector can see in a record.

A step the guard could not check (critical: its update was skipped unchecked), an LR that is
non-finite or negative (the cause is known: no replay), values found non-finite in the weights
(critical: the weights are not intact), each built from the step as it ended
(`stabilizer.step.step.OptimizerStep`), on a bad step only; and the root cause of a first
non-finite step (`root_cause`), found by replaying its micro-batches in a sandbox.

Nothing of the replay runs in steady state. On the first bad step of an episode the step's
micro-batches are run again (same weights, same batches, the random state captured at each
one's start) under hooks on every module (`stabilizer.live.locate.locate_nonfinite`), in a
sandbox (`stabilizer.live.sandbox`: gradients, buffers, random states, the modules' attributes
and the user's containers, generators and iterators put back), with the monitor `quiet` (its
hooks ignore the replay, its guard lets no optimizer step) and the host's own stand-ins
(`Host.replaying`: no optimizer or scheduler step, nothing logged). The first micro-batch that
reproduces the fault is reported; under DDP every rank's answer is gathered.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import torch

from stabilizer.core.isolated import Isolated
from stabilizer.core.kinds import GUARD_ERROR, IN_THE_LOSS, NONFINITE_UPDATE, ROOT_CAUSE
from stabilizer.core.records import Finding, Severity
from stabilizer.core.remedies import ROLLBACK, SKIP_STEP, UPCAST_TO_FP32
from stabilizer.live.held import HeldNonFinite
from stabilizer.live.locate import Localization, locate_nonfinite
from stabilizer.live.sandbox import sandbox

from .guard import BAD_LR, UNCHECKED
from .host import Host, MicroBatch
from .ranks import Ranks
from .step import OptimizerStep

__all__ = ["first_bad", "root_cause", "weights_not_intact"]

log = logging.getLogger("stabilizer")


def weights_not_intact(step: int, first: str, after: bool) -> Finding:
    """The critical finding of weights found non-finite (`first`: the first such tensor),
    before `step` or after the last step."""
    when = "after the last step" if after else f"before step {step}"
    message = (
        f"non-finite values in the weights {when} ({first}): an update that was let through, "
        "or code outside the optimizer, made them so; the weights are NOT intact. Resume "
        "from the last good checkpoint, and see docs/protection.md for what the guard "
        "cannot see"
    )
    return Finding(
        NONFINITE_UPDATE, step, step, Severity.CRITICAL, message,
        {"checked_step": float(step)}, ("optimizer",), (ROLLBACK,),
    )  # fmt: skip


def first_bad(step: OptimizerStep) -> Sequence[Finding]:
    """The findings of a first bad step that only the monitor knows (no replay needed)."""
    if step.reason == UNCHECKED or not step.checked:
        m = step.measurement
        error = m.error if m is not None else "not measured"
        message = f"the guard could not check this step ({error}): its update was skipped"
        unchecked = Finding(
            kind=GUARD_ERROR, step=step.step, end_step=step.step, severity=Severity.CRITICAL,
            seen=message,
        )  # fmt: skip
        return [unchecked]
    if step.reason == BAD_LR and step.measurement is not None:  # known cause: no replay
        lrs = [lr for lr in step.measurement.lrs if lr is not None]
        message = (
            f"the learning rate is non-finite or negative at step {step.step} (param groups: "
            f"{', '.join(f'{lr:g}' for lr in lrs)}): the update would be too; step skipped "
            "before the optimizer ran. Check the LR scheduler (a division by a zero step count, "
            "a NaN read from a config)"
        )
        evidence = {f"lr_{i}": lr for i, lr in enumerate(lrs)}
        bad_lr = Finding(
            NONFINITE_UPDATE, step.step, step.step, Severity.ERROR, message, evidence,
            ("optimizer",), (SKIP_STEP,),
        )  # fmt: skip
        return [bad_lr]
    return []


# --- the root cause: the step replayed -------------------------------------------------------


def root_cause(
    host: Host,
    micro: Sequence[MicroBatch],
    loss_scale: float,
    ranks: Ranks,
    step: int,
    *,
    strict: bool = False,
    quiet: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
    held: HeldNonFinite | None = None,
) -> Finding | None:
    """Replay the failing step's micro-batches and name the module (the module docstring).

    Micro-batches whose loss was non-finite are replayed first, then the others in order.
    `quiet` keeps the monitor's own hooks and guard out of it. None when the replay itself
    failed (warned; raised when `strict`). Under DDP every rank joins the gather of the
    answers, failed or not, so none waits.
    """
    where: Localization | None = None
    index = 0
    with Isolated(strict) as replay:
        with quiet(), sandbox(host.module) as box, host.replaying():
            for index in _replay_order(micro):
                with _trainable_as_it_began(micro[index]):
                    where = locate_nonfinite(
                        host.module, host.replay(micro[index], loss_scale),
                        rng_state=micro[index].rng, loss_scale=loss_scale,
                        inputs=micro[index].batch, held=held,
                    )  # fmt: skip
                if where.reproduced:
                    break
        if box.changed:
            log.warning("stabilizer: the replay wrote parameters in place: %s", box.changed)
    if replay.error is not None:
        log.warning("stabilizer: root-cause replay failed: %r", replay.error)
        where = None
    rank, where, index = _gather(ranks, where, index)
    if where is None:
        return None
    finding = _finding(step, where, host.replays_loss)
    # (a replay that stayed finite replayed them all: no one micro-batch to name)
    prefix = f"micro-batch {index + 1} of {len(micro)}: " if len(micro) > 1 else ""
    prefix = prefix if where.reproduced else ""
    if ranks.world_size > 1 and where.reproduced:
        prefix = f"rank {rank}: {prefix}"
    return replace(finding, seen=prefix + finding.seen) if prefix else finding


@contextlib.contextmanager
def _trainable_as_it_began(micro: MicroBatch) -> Iterator[None]:
    """The ``requires_grad`` flags as the micro-batch began, for its replay (the caller's
    after): a step that toggles them (Lightning's ``toggle_optimizer`` per optimizer) toggles
    them again from where it started, not from where the failing step left them."""
    given = micro.trainable or ()
    now = [(p, p.requires_grad) for p, _ in given]
    try:
        for p, flag in given:
            p.requires_grad_(flag)
        yield
    finally:
        for p, flag in now:
            p.requires_grad_(flag)


def _replay_order(micro: Sequence[MicroBatch]) -> list[int]:
    """Micro-batches with a non-finite loss first (read now: a failing step only)."""
    bad = [
        i for i, m in enumerate(micro)
        if any(not bool(torch.isfinite(loss).all()) for loss in m.losses)
    ]  # fmt: skip
    return bad + [i for i in range(len(micro)) if i not in bad]


def _gather(
    ranks: Ranks, where: Localization | None, index: int
) -> tuple[int, Localization | None, int]:
    """Under DDP, every rank's answer; the first that reproduced the fault wins."""
    rank = ranks.rank
    if ranks.world_size > 1:
        # The fault may sit on one rank only (our own processes' objects, never a log's).
        gathered = ranks.gather((where, index))
        answers = [(r, a[0], a[1]) for r, a in enumerate(gathered) if a and a[0] is not None]
        reproduced = [a for a in answers if a[1] is not None and a[1].reproduced]
        if reproduced or answers:
            return (reproduced or answers)[0]
    return rank, where, index


_OUTSIDE = (
    "the replay of the model's calls stayed finite: the NaN/Inf came from code outside the "
    "model (the loss computation, or what the training code did to the loss or the gradients), "
    "or the fault is transient"
)


def _finding(step: int, where: Localization, replays_loss: bool = True) -> Finding:
    # Names are relative to the host's module, in the location and in the message alike.
    module = None if where.module is None else _strip(where.module)
    parameter = None if where.parameter is None else _strip(where.parameter)
    where = replace(where, module=module, parameter=parameter)
    location = (module,) if module else ()
    severity = Severity.ERROR if where.reproduced else Severity.WARNING
    seen, evidence = where.message, where.evidence
    if not where.reproduced and not replays_loss:  # a finite replay of part of the step
        seen = _OUTSIDE
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
        remedies=(UPCAST_TO_FP32, SKIP_STEP) if numerical else (SKIP_STEP,),
    )  # fmt: skip


def _strip(name: str) -> str:
    # Names are relative to the LightningModule: drop the wrapper's attribute (``model.``).
    return name.removeprefix("model.")
