"""``AutoRemedies``: the ``auto`` policy applies the remedy each finding's kind calls for.

Which remedy answers which kind is the kinds table's (`Kind.auto`, `Kind.rollback_at` in
`stabilizer.core.kinds`; the table is in docs/remedies.md); the remedies themselves are the plain
functions of `stabilizer.live.remedies`. This module decides *when*, applies each remedy once
(never twice in a loop; a rollback at most ``max_rollbacks`` times, and a rollback cuts a surged
LR back: an LR at least twice the highest used up to its snapshot, or the scheduler's initial
LR if higher, so that a warmup's end is no surge), and reports every application as a
``remedy_applied`` finding with the numbers before and after. It acts only on a failure seen in
the run's own numbers: the preflight's ``config_risk`` findings are advice, never a remedy.
Every remedy is then watched (`Ladder`): a ``remedy_result`` finding says whether it worked.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Sequence

from torch import nn

from stabilizer.core.kinds import CLIP_SATURATION, DEPTH_IMBALANCE, kind_of
from stabilizer.core.records import Finding, Severity, StepRecord
from stabilizer.core.remedies import (
    CLIP_GRADIENTS,
    REWRITES,
    ROLLBACK,
    SCALE_LR,
    SWAP_TO_PRE_LN,
    UPCAST_TO_FP32,
    remedy,
)
from stabilizer.core.run import low_precision
from stabilizer.core.signals import GRAD_NORM, LOSS, LR
from stabilizer.live.remedies import (
    LRMultiplier,
    SkipWindow,
    Snapshots,
    swap_to_pre_ln,
    upcast_to_fp32,
)
from stabilizer.live.remedies.swap_to_pre_ln import has_post_ln

from .host import Host
from .ladder import Applied, Ladder, Result, applied_finding, cause_of, result_finding
from .policies import Auto
from .protect import Remedies
from .swap import add_param_group

__all__ = ["CLIP_MARGIN", "AutoRemedies", "from_scratch"]

log = logging.getLogger("stabilizer")

CLIP_MARGIN = 2.0
"""Where a run's typical healthy gradient norm (the median of its last `HEALTHY_NORMS` healthy
steps) is above the article's 1.0, clipping starts at this many times it: clipping at 1.0 would
clip most healthy steps (a change of optimizer, not a remedy), so the threshold comes from the
run's own norms."""

HEALTHY_NORMS = 50  # the last healthy steps' gradient norms the threshold is read from

SURGE = 2.0  # a rollback cuts the LR when it is at least this many times the snapshot's


class AutoRemedies(Remedies):
    """Applies the remedies of the table above to a running training (the `Auto` policy).

    Args:
        host: The training loop.
        policy: The `Auto` policy's knobs.
    """

    def __init__(self, host: Host, policy: object) -> None:
        super().__init__(host, policy)
        assert isinstance(policy, Auto)
        self.policy = policy
        self.allow, self.explicit = policy.allowed, policy.explicit
        self.snapshot_every, self.max_rollbacks = policy.snapshot_every, policy.max_rollbacks
        self.skip_batches, self.swap_before = policy.skip_batches, policy.swap_before
        self.warmup_steps = policy.warmup_steps
        self.lr = LRMultiplier()
        self.skip = SkipWindow()
        self._snapshots: Snapshots | None = None
        self._last_trouble = -(10**9)  # step of the last finding at WARNING or above
        self._exhausted = False
        self.ladder = Ladder(policy.check_steps)
        self._snapshot_lr: dict[int, float] = {}  # snapshot step -> the highest LR used up to it
        self._step_lr = math.nan
        self._lr_high = -math.inf  # the highest LR the steps have used
        self._norms: deque[float] = deque(maxlen=HEALTHY_NORMS)  # healthy steps' gradient norms
        self.stop_reason = "no rollback left"
        self._clip: float | None = None  # the clipping threshold auto put in force

    @property
    def lr_factor(self) -> float:
        return self.lr.factor

    def stepping_past(self, step: int) -> bool:
        return self.skip.active(step)

    def start(self, resumed: bool) -> None:
        optimizer = self.host.optimizers[0]
        self.lr.attach(optimizer)
        if resumed:
            self._in_force_again()
        if ROLLBACK in self.allow:
            self._snapshots = Snapshots(
                self.host.module,
                optimizer,
                every=self.snapshot_every,
                max_restores=self.max_rollbacks,
                directory=self.policy.snapshot_dir,
                keep=self.policy.keep_snapshots,
            )

    def _in_force_again(self) -> None:
        """A resumed run: the remedies its checkpoint's run had applied are put back (the
        LR multiplier is in its state; the swap to pre-LN of a Lightning checkpoint loads with
        the model, `stabilizer.step.swap`)."""
        if self._clip is not None:
            self.host.set_clip(self._clip)
        if self.applied.get(UPCAST_TO_FP32):
            upcast_to_fp32(self.host.module)
        if self.applied.get(SWAP_TO_PRE_LN) and has_post_ln(self.host.module):
            swap = swap_to_pre_ln(self.host.module)
            if swap.new_parameters:
                add_param_group(self.host, list(swap.new_parameters))

    def stop(self) -> None:
        self.lr.detach()

    def after_step(
        self,
        step: int,
        found: Sequence[Finding],
        record: StepRecord | None = None,
    ) -> list[Finding]:
        """Apply what the step's findings call for; returns the ``remedy_applied`` findings and
        the ``remedy_result`` findings of the remedies whose verdict is due."""
        if any(f.severity >= Severity.WARNING for f in found):
            self._last_trouble = step
        elif record is not None and math.isfinite(record.values.get(GRAD_NORM, math.nan)):
            self._norms.append(record.values[GRAD_NORM])
        loss = record.values.get(LOSS, math.nan) if record is not None else math.nan
        # the LR this step's update used (the scheduler has already set the next one)
        self._step_lr = record.values.get(LR, math.nan) if record is not None else math.nan
        if self._step_lr > self._lr_high:  # NaN never is
            self._lr_high = self._step_lr
        snapshots = self._snapshots
        self._exhausted = any(
            self._wants_rollback(f)
            and not (snapshots is not None and snapshots.can_restore(before=_last_clean(f)))
            for f in found
        )
        # What fails while a rollback steps past the bad data is that data: no verdict on it.
        verdicts = self.ladder.check(step, [] if self.skip.active(step) else found, loss)
        out: list[Finding] = []
        answered: dict[int, str] = {}  # id of a finding -> the remedy applied for it
        for finding in found:
            applied = self._apply(step, finding)
            if applied is not None:
                answered[id(finding)] = applied.name
                out.append(self._applied(step, finding, applied, loss))
        for verdict in verdicts:
            out.extend(self._verdict(step, verdict, answered, loss))
        quiet = step - self._last_trouble >= self.snapshot_every
        saving = self._snapshots is not None and quiet and not self.skip.active(step)
        if saving and self._snapshots is not None and self._snapshots.maybe_save(step):
            self._snapshot_lr[step] = self._lr_high
        return out

    def _applied(self, step: int, cause: Finding, applied: Applied, loss: float) -> Finding:
        self.applied[applied.name] = self.applied.get(applied.name, 0) + 1
        self.ladder.watch(applied.name, cause, step, loss)
        if applied.name == SWAP_TO_PRE_LN:
            self.ladder.watches[-1].until += self.warmup_steps  # judged once re-warmed
        return applied_finding(step, cause, applied)

    def _verdict(
        self,
        step: int,
        verdict: Result,
        answered: dict[int, str],
        loss: float,
    ) -> list[Finding]:
        """The ``remedy_result`` of `verdict`, and the next remedy when it did not work."""
        because = verdict.because
        if verdict.worked or not verdict.failed:  # (not better, not failing: left alone)
            return [result_finding(step, verdict, None, self.ladder.tried)]
        nxt = answered.get(id(because)) if because is not None else None
        extra: list[Finding] = []
        if nxt is None:
            applied = self._escalate(step, verdict)
            if applied is not None:
                nxt = applied.name
                extra.append(self._applied(step, because or cause_of(verdict), applied, loss))
                if because is not None:  # (another remedy it refutes is answered by this one)
                    answered[id(because)] = nxt
        if nxt is None:
            self._exhausted = True
            self.stop_reason = f"{verdict.watch.remedy} did not work and nothing is left to try"
        return [result_finding(step, verdict, nxt, self.ladder.tried), *extra]

    def _escalate(self, step: int, verdict: Result) -> Applied | None:
        name = remedy(verdict.watch.remedy).next
        if name is None or name not in self.allow:
            return None
        if name == ROLLBACK:
            since = verdict.because.step if verdict.because is not None else verdict.watch.step
            return self._rollback(step, since - 1)
        if self.applied.get(name):
            return None
        return self._remedy(step, name)

    def should_stop(self) -> tuple[bool, str]:
        """Stop when the last step's findings called for a rollback that could not be done, or
        a remedy failed with nothing left to try."""
        return self._exhausted, self.stop_reason if self._exhausted else ""

    def _wants_rollback(self, f: Finding) -> bool:
        # (a divergence's closing INFO finding, the loss came back, calls for nothing)
        at = kind_of(f.kind).rollback_at
        return ROLLBACK in self.allow and at is not None and f.severity >= at

    def _apply(self, step: int, f: Finding) -> Applied | None:
        if self._wants_rollback(f):
            return self._rollback(step, _last_clean(f))
        if f.kind == CLIP_SATURATION and self.applied.get(CLIP_GRADIENTS):
            return self._raise_clip()  # the saturation is auto's own: no LR cut for it
        name = kind_of(f.kind).auto
        if name is None or name not in self.allow or self.applied.get(name):
            return None  # each of these remedies once: never twice in a loop
        if name in REWRITES and name not in self.explicit and not from_scratch(self.host.module):
            return None  # a pretrained or partly frozen model is not rewritten unasked
        if name == SWAP_TO_PRE_LN and f.kind == DEPTH_IMBALANCE:
            return self._swap(step, since=_last_clean(f))
        return self._remedy(step, name)

    def _remedy(self, step: int, name: str) -> Applied | None:
        if name == CLIP_GRADIENTS:
            threshold, why = self._clip_threshold()
            before = self.host.clip
            if before is not None and 0.0 < before <= threshold:
                return None  # a tighter threshold is kept: the remedy never loosens clipping
            self.host.set_clip(threshold)
            self._clip = threshold
            message = f"gradient clipping at norm {threshold:.3g} ({why})"
            after = {"before": before if before else float("inf"), "after": threshold}
            return Applied(name, message, after)
        if name == SCALE_LR:
            change = self.lr.scale(0.5)
            return Applied(name, "LR halved", {"before": change.before, "after": change.after})
        if name == UPCAST_TO_FP32:
            if low_precision(self.host.facts.precision) is False:
                return None  # norms and softmax already run in fp32 (or wider): nothing to do
            up = upcast_to_fp32(self.host.module)
            if not up.changed:
                return None
            count = {"norms": float(len(up.norms)), "attention": float(len(up.attention))}
            count["unswitched"] = float(len(up.unswitched))
            return Applied(name, up.said, count)
        return self._swap(step)

    def _clip_threshold(self) -> tuple[float, str]:
        """The article's 1.0 where the run's typical healthy norm is below it; else
        `CLIP_MARGIN` times that norm. And why, in words."""
        if len(self._norms) < 10:
            return 1.0, "the article's rule; too few healthy steps to read the run's own norms"
        typical = statistics.median(self._norms)
        if typical <= 1.0:
            return 1.0, f"the article's rule: the run's typical healthy norm is {typical:.3g}"
        return CLIP_MARGIN * typical, (
            f"{CLIP_MARGIN:g}x the run's typical healthy norm of {typical:.3g}: at the article's "
            "1.0 it would clip most healthy steps"
        )

    def _raise_clip(self) -> Applied | None:
        """Clipping that auto switched on saturates: the run's norms grew past the threshold.
        Raise it to fit them (never an LR cut for a saturation auto caused)."""
        threshold, why = self._clip_threshold()
        before = self.host.clip
        if before is None or threshold <= float(before) or len(self._norms) < 10:
            return None
        self.host.set_clip(threshold)
        self._clip = threshold
        message = f"clipping threshold raised from {float(before):.3g} to {threshold:.3g} ({why})"
        return Applied(CLIP_GRADIENTS, message, {"before": float(before), "after": threshold})

    def _swap(self, step: int, since: int | None = None) -> Applied | None:
        """Swap to pre-LN and re-warm the LR; first, when the oldest snapshot held is from
        before `since` (the last step before the band), restart from it: pre-LN learns from
        the weights of a stuck post-LN run far slower than from earlier ones (measured on
        post-ln-deep: a swap in place at step 29 ended 1.20x its twin, a restart from step 50
        1.13x, from step 0 0.90-1.04x over 5 seeds; docs/remedies.md, row 3). The restart uses
        one of the `max_rollbacks`."""
        module = self.host.module
        if step >= self.swap_before or not has_post_ln(module):
            return None  # the finding's advice stands: restart with pre-LN
        snapshots, oldest = self._snapshots, self._oldest_before(since)
        restart = None  # (restored before the swap adds any parameter)
        if snapshots is not None and oldest is not None:
            restart = snapshots.restore(before=oldest + 1)
        swap = swap_to_pre_ln(module)
        if swap.new_parameters:
            add_param_group(self.host, list(swap.new_parameters))
        self.lr.warmup(self.warmup_steps)
        evidence = {"blocks": float(len(swap.blocks)), "warmup_steps": float(self.warmup_steps)}
        message = f"{len(swap.blocks)} blocks now pre-LN"
        if restart is not None:
            evidence["restored_step"] = float(restart)
            message += f", restarted from step {restart}'s weights and optimizer state"
        message += f"; LR re-warmed over {self.warmup_steps}"
        return Applied(SWAP_TO_PRE_LN, message, evidence)

    def _oldest_before(self, since: int | None) -> int | None:
        """The oldest snapshot's step when it is from before `since` and can be restored."""
        snapshots = self._snapshots
        if snapshots is None or since is None or not snapshots.steps:
            return None
        oldest = snapshots.steps[0]
        return oldest if oldest < since and snapshots.can_restore(before=oldest + 1) else None

    def _rollback(self, step: int, since: int) -> Applied | None:
        if self._snapshots is None or not self._snapshots.can_restore(before=since):
            return None
        lr_now = self._step_lr
        restored = self._snapshots.restore(before=since)
        until = self.skip.start(step + 1, self.skip_batches)
        message = (
            f"rolled back to step {restored}'s weights and optimizer state; the next "
            f"{self.skip_batches} updates skipped (to step {until})"
        )
        evidence = {"restored_step": float(restored), "skip_until": float(until)}
        # A surge is an LR above any the run had trained with, or the schedule's own (the end of
        # a warmup after a snapshot from within it is none).
        lr_then = max(self._snapshot_lr.get(restored, -math.inf), _initial_lr(self.host))
        if 0 < lr_then < math.inf and lr_now >= SURGE * lr_then:  # surged: cut it as much
            change = self.lr.scale(lr_then / lr_now)
            message += (
                f"; LR cut {lr_now / lr_then:.3g}x (the highest before was {lr_then:.3g}, "
                f"now {lr_now:.3g})"
            )
            evidence.update(lr_then=lr_then, lr_now=lr_now, lr_factor=change.after)
        return Applied(ROLLBACK, message, evidence)

    def state_dict(self) -> dict[str, object]:
        return {
            "applied": dict(self.applied),
            "lr": self.lr.state_dict(),
            "ladder": self.ladder.state_dict(),
            "clip": self._clip,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        applied = state.get("applied", {})
        self.applied = {str(k): int(v) for k, v in dict(applied).items()}  # type: ignore[call-overload]
        clip = state.get("clip")
        self._clip = float(clip) if isinstance(clip, int | float) else None
        lr = state.get("lr")
        if isinstance(lr, dict):
            self.lr.load_state_dict(lr)
        ladder = state.get("ladder")
        if isinstance(ladder, dict):
            self.ladder.load_state_dict(ladder)


def from_scratch(module: nn.Module) -> bool:
    """Whether `module` is trained from scratch: every parameter trainable, and no sign of
    pretrained weights (a Hugging Face model loaded with ``from_pretrained`` keeps the name it
    came from in ``config._name_or_path``; one built from a config has none)."""
    if any(not p.requires_grad for p in module.parameters()):
        return False
    for m in module.modules():
        if getattr(getattr(m, "config", None), "_name_or_path", ""):
            return False
    return True


def _initial_lr(host: Host) -> float:
    """The first param group's LR as its torch scheduler started it (``initial_lr``), or -inf."""
    opts = host.optimizers
    groups = opts[0].param_groups if opts else []
    value = groups[0].get("initial_lr") if groups else None
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else -math.inf


def _last_clean(f: Finding) -> int:
    """Snapshots taken before this step hold no update of the trouble: the loss of step s is
    measured before step s's update, so a loss first up at s was caused by an update of step
    s - 1 or earlier (or by the batch of s itself), and a snapshot from s - 1 already holds it."""
    return f.step - 1
