"""Which remedies fit the run: one rule, which every output follows.

A detector suggests remedies from what it saw; whether each fits depends on facts it does not
see: the run's precision, what was done already (a step the guard or the grad scaler skipped),
and how the episode ended. `fitting_remedies` decides, and `advised` gives the finding as the
outputs show it: its remedies, and its advice in words, only what fits. The console, the JSONL
log, TensorBoard, notifications, ``stabilizer watch`` and the reports of ``stabilizer diagnose``
all call it, so that one finding gets one advice everywhere. The rules:

- fp32 islands and fp32 master weights (`LOW_PRECISION_REMEDIES`) are no advice in an fp32 run,
  nor for a NaN made in the loss (its root cause found every module output finite);
- "skip the step" is no advice when the step was skipped (by the guard or a grad scaler);
- "roll back" is no advice for a NaN/Inf episode the run recovered from with its bad steps
  skipped: the weights never took them, and the run went on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from .kinds import IN_THE_LOSS, ROOT_CAUSE, kind_of
from .records import Finding
from .remedies import LOW_PRECISION_REMEDIES, ROLLBACK, SKIP_STEP, TABLE

__all__ = [
    "LOW_PRECISION_REMEDIES",
    "REMEDY_TEXT",
    "RunFacts",
    "advised",
    "fitting_remedies",
    "in_the_loss",
    "remedy_text",
]

REMEDY_TEXT: dict[str, str] = {r.name: r.text for r in TABLE}
"""What to do, by remedy name: the remedy table's words (`stabilizer.core.remedies`)."""

_IN_BF16 = {r.name: r.text_bf16 for r in TABLE if r.text_bf16}
"""The text of a remedy in a run that is in bf16 already (no "switch to bf16")."""


@dataclass(frozen=True)
class RunFacts:
    """What is known of the run beyond its findings.

    Args:
        fp16: A loss scale was logged (fp16 mixed precision); False: not known to be fp16.
        skipped: Spans of steps ``(first, last)`` in which an update was skipped (by the
            monitor's guard or a grad scaler).
        low_precision: Whether the run computed in 16 bits (the live trainer's precision, or
            the header of its ``stability.jsonl``): False for an fp32 run, None when not known.
        precision: The run's precision when known (``"bf16-mixed"``, ``"16-mixed"``, ``""``).
        not_fp16: The log shows the run has no fp16 loss scaler (Megatron's loss scale fixed
            at 1.0: bf16 or fp32), though its precision is not known.
    """

    fp16: bool = False
    skipped: tuple[tuple[int, int], ...] = ()
    low_precision: bool | None = None
    precision: str = ""
    not_fp16: bool = False

    def was_skipped(self, step: int) -> bool:
        """Whether the update of ``step`` was (as far as the log tells) skipped."""
        return any(first <= step <= last for first, last in self.skipped)

    def with_skipped(self, step: int) -> RunFacts:
        """These facts with the update of ``step`` skipped too (a step after the last span
        extends it; a live run's steps come in order)."""
        spans = self.skipped
        if spans and spans[-1][0] <= step <= spans[-1][1] + 1:
            spans = (*spans[:-1], (spans[-1][0], max(step, spans[-1][1])))
        else:
            spans = (*spans, (step, step))
        return replace(self, skipped=spans)


def in_the_loss(findings: Iterable[Finding]) -> bool:
    """Whether a root cause found the NaN/Inf outside every module (in the loss)."""
    return any(f.kind == ROOT_CAUSE and f.evidence.get(IN_THE_LOSS, 0.0) >= 0.5 for f in findings)


def fitting_remedies(
    remedies: Sequence[str],
    findings: Sequence[Finding],
    facts: RunFacts,
    *,
    recovered: bool | None = None,
) -> tuple[str, ...]:
    """The remedies that fit the run's facts, each once, in their order (module docstring).

    Args:
        remedies: The names suggested, most useful first.
        findings: The findings of the episode they answer (a root cause among them tells a NaN
            made in the loss; their steps tell whether the steps were skipped).
        facts: What is known of the run.
        recovered: Whether the run recovered from the episode (the loss came back finite and
            the run went on); None when not known yet (a live run).
    """
    dropped: set[str] = set()
    if in_the_loss(findings) or facts.low_precision is False:
        dropped |= LOW_PRECISION_REMEDIES
    rows = [(kind_of(f.kind), f) for f in findings]
    nonfinite = [(row, f) for row, f in rows if (row.nan and row.detector) or row.scaler_skips]
    if nonfinite and all(row.scaler_skips or facts.was_skipped(f.step) for row, f in nonfinite):
        dropped.add(SKIP_STEP)
        if recovered:
            dropped.add(ROLLBACK)
    return tuple(name for name in dict.fromkeys(remedies) if name not in dropped)


def remedy_text(name: str, kind: str = "", facts: RunFacts | None = None) -> str:
    """The action a remedy name stands for (after a finding of ``kind``, in a run of ``facts``,
    where that changes it); an unknown name is returned as it is."""
    special = kind_of(kind).remedy_text.get(name)
    if special:
        return special
    in_bf16 = facts is not None and (facts.precision.startswith("bf16") or facts.not_fp16)
    if in_bf16 and name in _IN_BF16:  # ("switch to bf16" is no advice to a run in bf16 or fp32)
        return _IN_BF16[name]
    return REMEDY_TEXT.get(name, name)


def advised(
    finding: Finding,
    facts: RunFacts,
    context: Sequence[Finding] = (),
    *,
    recovered: bool | None = None,
) -> Finding:
    """``finding`` as the outputs show it: the remedies that fit (`fitting_remedies`), and
    advice in words that says no more than they do.

    The detector's own advice stays when every remedy fits; else it is the action of the first
    remedy that fits (`remedy_text`: what to do first, as the verdict of ``diagnose`` says it;
    the remedies list the rest), or none (nor for a finding that had none).

    Args:
        finding: As the engine found it.
        facts: What is known of the run.
        context: The other findings of its episode, or of its step (a root cause).
        recovered: See `fitting_remedies`.
    """
    if not finding.remedies:
        return finding
    episode = [finding, *(f for f in context if f is not finding)]
    fitting = fitting_remedies(finding.remedies, episode, facts, recovered=recovered)
    if fitting == finding.remedies:
        return finding
    if not (fitting and finding.advice):  # (a finding whose message had no advice gets none)
        return replace(finding, remedies=fitting, advice="")
    return replace(finding, remedies=fitting, advice=remedy_text(fitting[0], finding.kind, facts))
