"""What each finding means and what to do about it, as the reports say it.

A kind's title, usual cause and remedies are its row in `stabilizer.core.kinds`; here is what
the reports add: each remedy's action in words, and the cause and remedies that fit what the
episode's evidence and the run's log tell (a NaN made in the loss, an fp32 run, skipped steps).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from stabilizer.core.kinds import IN_THE_LOSS, LOSS_SPIKE, ROOT_CAUSE, Kind, kind_of
from stabilizer.core.records import Finding
from stabilizer.outputs.wording import LOW_PRECISION_REMEDIES

__all__ = [
    "REMEDY_TEXT",
    "RunFacts",
    "advice_for",
    "cause_for",
    "fitting_remedies",
    "in_the_loss",
    "remedy_text",
]

REMEDY_TEXT: dict[str, str] = {
    "clip_gradients": "clip the global gradient norm to 1.0",
    "upcast_to_fp32": "run softmax and LayerNorm in fp32 (fp32 islands), or switch to bf16",
    "swap_to_pre_ln": "move to pre-LN residual blocks and keep the LR warmup",
    "skip_step": "skip the step, so that a bad (NaN/Inf or outsized) update never reaches the "
    "weights",
    "rollback": "roll back to the last good checkpoint and step past the bad batch",
    "scale_lr": "lower the learning rate",
    "lr_warmup": "warm the learning rate up over the first few hundred steps",
    "mixed_precision": "keep fp32 master weights (16-mixed/bf16-mixed) or raise the optimizer's "
    "eps (1e-8 is 0 in fp16)",
}
"""What to do, by remedy name (the names of `stabilizer.core.records.REMEDIES`)."""


@dataclass(frozen=True)
class RunFacts:
    """What a log tells about the run, beyond its findings.

    Args:
        fp16: A loss scale was logged (fp16 mixed precision); False: not known to be fp16.
        skipped: Spans of steps ``(first, last)`` in which an update was skipped (by the
            monitor's guard or a grad scaler).
        low_precision: Whether the run computed in 16 bits, from the run's header in
            ``stability.jsonl``: False for an fp32 run, None when the log does not say.
    """

    fp16: bool = False
    skipped: tuple[tuple[int, int], ...] = ()
    low_precision: bool | None = None

    def was_skipped(self, step: int) -> bool:
        """Whether the update of ``step`` was (as far as the log tells) skipped."""
        return any(first <= step <= last for first, last in self.skipped)


_LOSS_CAUSE = (
    "the loss computation or its inputs: every module output was finite, so look at the loss "
    "itself (a log of 0, a division by a count of 0, NaN labels or loss weights)"
)


def in_the_loss(findings: Iterable[Finding]) -> bool:
    """Whether a root cause found the NaN/Inf outside every module (in the loss)."""
    return any(f.kind == ROOT_CAUSE and f.evidence.get(IN_THE_LOSS, 0.0) >= 0.5 for f in findings)


def cause_for(kind: str, findings: Sequence[Finding], facts: RunFacts) -> str:
    """The usual cause of ``kind``, as far as the episode's evidence and the run tell."""
    row = kind_of(kind)
    if row.nan and in_the_loss(findings):
        return _LOSS_CAUSE
    if facts.low_precision is False and row.cause_fp32:
        return row.cause_fp32
    if not facts.fp16 and row.cause_not_fp16:
        return row.cause_not_fp16
    if kind == LOSS_SPIKE:
        return _spike_cause(next(f for f in findings if f.kind == kind))
    return row.cause


def _spike_cause(spike: Finding) -> str:
    """A loss spike's cause as its evidence tells: one step up or several, recovered or not."""
    if spike.end_step is None or spike.end_step == spike.step:
        cause = "one batch with an outsized gradient pushed the weights off course"
    else:  # (a log may not hold every step: the span, not a count of bad steps)
        cause = (
            f"the loss stayed up from step {spike.step} to {spike.end_step}, not for one step: "
            "a run of bad batches (corrupt or mislabelled data, a bad shard), or one outsized "
            "update the weights took that long to undo"
        )
    recovered = spike.evidence.get("recovered", 1.0) >= 0.5
    return cause + ("; the run recovered" if recovered else "; not back by the end of the log")


def fitting_remedies(
    remedies: Sequence[str], findings: Sequence[Finding], facts: RunFacts
) -> tuple[str, ...]:
    """The remedies that the evidence supports, each once, in their order.

    A NaN made in the loss, or in a run whose header says fp32, gets no fp32 islands (nor bf16,
    nor fp32 master weights), as on the live console; ``skip_step`` is dropped where the step was
    skipped already.
    """
    dropped: set[str] = set()
    if in_the_loss(findings) or facts.low_precision is False:
        dropped |= LOW_PRECISION_REMEDIES
    rows = [(kind_of(f.kind), f) for f in findings]
    nonfinite = [(row, f) for row, f in rows if row.nan or row.scaler_skips]
    if nonfinite and all(row.scaler_skips or facts.was_skipped(f.step) for row, f in nonfinite):
        dropped.add("skip_step")
    return tuple(name for name in dict.fromkeys(remedies) if name not in dropped)


def advice_for(kind: str) -> Kind:
    """The row of a finding kind (title, cause, ...); an unknown kind gets its own name and a
    neutral cause."""
    return kind_of(kind)


def remedy_text(name: str, kind: str = "") -> str:
    """The action a remedy name stands for (after a finding of ``kind``, where that changes it);
    an unknown name is returned as it is."""
    return kind_of(kind).remedy_text.get(name) or REMEDY_TEXT.get(name, name)
