"""`Diverged`: a run that is broken from the first record of its log on, by absolute bounds."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from stabilizer.core.kinds import DIVERGED, kind_of
from stabilizer.core.records import Finding, Severity, StepRecord
from stabilizer.core.signals import GRAD_NORM, LOSS, PPL, VOCAB_SIZE

from ._chance import VOCABULARIES
from .base import check_at_least

__all__ = [
    "BEYOND_CHANCE",
    "GRAD_ALONE",
    "GRAD_WITH_LOSS",
    "LOSS_WITH_GRAD",
    "OUT_OF_PROPORTION",
    "Diverged",
]

_WHOLE = 2  # a log this long or longer, out of range on every record, is broken as a whole

GRAD_ALONE = 1e8
"""A gradient norm that, out of all proportion to its loss (`OUT_OF_PROPORTION`), no healthy run
shows: four orders of magnitude above the largest we know of a language model that still
trained (BigScience's 104B at 1.3e4 on the eve of a spike; language models show 0.1-10 after
warm-up and up to ~100 at initialisation, detection models up to ~1e3 and, for a step or two at
their start, ~7e3). A regression on prices in dollars trains well with gradient norms of 1e7-8e8
beside its loss of 1e7-4e8 (benchmarks/regimes, ``huge-scale``): the gradient scales with the
targets, so alone it proves nothing."""

OUT_OF_PROPORTION = 1e6
"""How many times its loss a gradient norm of `GRAD_ALONE` or more must be to be broken on its
own: grokfast#9's 3.8e12 beside a loss of 11 is 3e11 times it; healthy runs stay below ~1e3
(a detection model's 7e3 beside a loss of ~5; the dollar regression's 8e8 beside 4e8 is 2)."""

GRAD_WITH_LOSS = 2e5
"""A gradient norm that, with a loss of `LOSS_WITH_GRAD` or more beside it, an excerpt of a
healthy language or vision model does not show: fifteen times the largest healthy one we know
(1.3e4), a third of openpi#814's least. Judged only in a log that begins after its run's start:
at the start, those levels are a regression's own scale."""

LOSS_WITH_GRAD = 1e7
"""A loss that, with a gradient norm of `GRAD_WITH_LOSS` or more, is broken in an excerpt: ten
times above the 1e6 of a regression on unnormalised targets late in training, and beyond any
cross-entropy (ln of the largest vocabulary is 12.5) or summed loss of a healthy run we know
(1e4)."""


BEYOND_CHANCE = 1.25
"""How many times the chance level ln V a perplexity's log (its per-token loss, in nats) must be
to be worse than any model that learnt, or started, anything: a uniform guess over V tokens has
perplexity V, an initialised language model about V (its loss ln V, up to ~5% above); 1.25 ln V
is a perplexity of V^1.25 (2.6e6 for 130k tokens). V is the vocabulary the log states, else the
largest of the tokenizers' (`VOCABULARIES`): PyTorch's word_language_model at LR 20 prints ``loss
17.74 | ppl 50880577`` on WikiText-2 (33k words); OpenNMT caps its printed perplexity at exp(100)
(2.7e43) and prints that from its first line when the run is broken."""

_LARGEST = float(max(VOCABULARIES))


class Diverged:
    """A run broken before its log begins (the first records far out of range), or, by its
    perplexity, anywhere in it.

    Requires: ``grad_norm`` or ``ppl``; ``loss`` when logged.
    Rule: from the first record of the stream on, `records` records or more in a row (or, out of
    all proportion, every record of a log of 2 or more that ends before `records`) with a
    gradient norm of `GRAD_ALONE` or more and `OUT_OF_PROPORTION` times its loss or more (or no
    loss logged), or, in a log that begins after its run's start, of `GRAD_WITH_LOSS` or more
    beside a loss of `LOSS_WITH_GRAD` or more (openpi#814: from step 5900, gradient norms
    5e5-1.2e6, losses 2e8-7e8, every record), or with a perplexity whose log is `BEYOND_CHANCE`
    times ln V or more (worse than a uniform guess: a perplexity is known to be a per-token
    cross-entropy's exp, which a loss is not). A log begins at its run's start when its first
    step is 1 or less, or no more than the steps between its first two records (a run logged
    every 100 steps from step 100): its first levels are then the run's own scale, never a
    divergence from an earlier healthy level (a live run from step 0 is one). A perplexity is
    judged past the first records too: `records` in a row beyond chance anywhere in a log are a
    run that diverged there (no healthy model, started or trained, is worse than guessing).

    The other detectors judge change against the run's own earlier records; an excerpt that
    starts already broken has no healthy record to compare with. A person still sees it: a
    gradient norm or a loss orders of magnitude beyond what any healthy run shows. The bounds
    are kept far from healthy runs (see the constants); a loss alone is never judged by its
    level (a regression on unnormalised targets has losses of 1e6 and more and trains well, and a
    reader keeps no word of what kind of loss it read). One ``diverged`` (ERROR) when the
    `records` are in, updated with its last step when it ends or the log does; a stream whose
    first record is in range is never judged again (its changes are the spike detectors' job).

    Args:
        records: Records in a row, from the first, that make the finding.
    """

    name: ClassVar[str] = "diverged"
    requires: ClassVar[tuple[str, ...]] = (GRAD_NORM, PPL)

    def __init__(self, records: int = 3) -> None:
        check_at_least("records", records, 1)
        self.records = records
        # Past the out-of-range records the stream began with: nothing left to judge (the
        # engine stops feeding it).
        self.done = False
        self._first: int | None = None  # the stream's first step
        self._begins: bool | None = None  # whether it shows its run's start (from 2 records)
        self._by_level = False  # a record of the stretch is out of range by its loss's level
        self._start: int | None = None
        self._end = 0
        self._count = 0  # out-of-range records so far
        self._reported = 0  # their count when reported (0: not yet)
        self._worst = (0.0, 0.0)  # the largest gradient norm and loss seen in the stretch
        self._ppl = 0.0  # the largest perplexity beyond chance seen in the stretch
        self._vocab = _LARGEST  # the vocabulary it was judged against
        self._later = False  # past the first records: only perplexities are judged (`_past`)

    def update(self, record: StepRecord) -> list[Finding]:
        if self.done:
            return []
        values = record.values
        grad, ppl = values.get(GRAD_NORM), values.get(PPL)
        if grad is None and ppl is None:  # (a record without either changes nothing)
            return []
        if self._later:
            return self._past(record.step, ppl, values.get(VOCAB_SIZE))
        loss = values.get(LOSS)
        if self._first is None:
            self._first = record.step
            self._begins = True if record.step <= 1 else None
        elif self._begins is None:
            self._begins = self._first <= record.step - self._first
        beyond = ppl is not None and _beyond_chance(ppl, values.get(VOCAB_SIZE))
        alone = beyond or (grad is not None and _out_of_proportion(grad, loss))
        self._by_level = self._by_level or not alone
        ranged = alone or (grad is not None and _out_of_range(grad, loss))
        if not ranged or (self._begins and self._by_level):
            return self._close(ppl is not None)
        self._start = record.step if self._start is None else self._start
        self._end, self._count = record.step, self._count + 1
        level = loss if loss is not None and math.isfinite(loss) else 0.0
        self._worst = (max(self._worst[0], grad or 0.0), max(self._worst[1], level))
        if beyond and ppl is not None:
            self._ppl = max(self._ppl, ppl)
            self._vocab = _vocabulary(values.get(VOCAB_SIZE))
        if self._count == self.records:
            self._reported = self._count
            return [self._finding("")]
        return []

    def _close(self, perplexity: bool) -> list[Finding]:
        """The stretch of out-of-range records is over (or never began): judging ends, but for
        the perplexities of a log that prints one (``perplexity``), judged from here on."""
        grew = self._reported and self._count > self._reported
        found = [self._finding(f", in range again after step {self._end}")] if grew else []
        self.done, self._later = not perplexity, perplexity
        self._start, self._count, self._reported, self._ppl = None, 0, 0, 0.0
        self._worst, self._by_level = (0.0, 0.0), False
        return found

    def _past(self, step: int, ppl: float | None, stated: float | None) -> list[Finding]:
        """A record past the first ones: a perplexity beyond chance, `records` in a row, is a
        run that diverged mid-log (PyTorch's word_language_model at LR 20, an excerpt of its
        epoch 4: ppl 2e5-7e5, then 1.2e6, 8.7e6, 3.0e7 and staying)."""
        if ppl is None:
            return []  # (a record without a perplexity: a gradient norm's, an evaluation's)
        if not _beyond_chance(ppl, stated):
            return self._close(True) if self._start is not None else []
        self._start = step if self._start is None else self._start
        self._end, self._count = step, self._count + 1
        self._ppl, self._vocab = max(self._ppl, ppl), _vocabulary(stated)
        if self._count == self.records:
            self._reported = self._count
            return [self._finding("")]
        return []

    def _finding(self, outcome: str) -> Finding:
        assert self._start is not None
        grad, loss = self._worst
        bound = f" beside a loss of up to {loss:.3g}" if self._by_level else ""
        seen = (
            f"gradient norm up to {grad:.3g}{bound} on every one of the {self._count} records "
            f"since step {self._start}, the first of the log{outcome}: orders of magnitude "
            "beyond a healthy language or vision model's (their gradient norms stay below "
            "~1e4): the run had diverged before its first logged step"
        )
        if self._ppl:  # (by its perplexity: worse than guessing)
            what = "the largest vocabulary we know" if self._vocab == _LARGEST else "as stated"
            first, when = ", the first of the log", "had diverged before its first logged step"
            if self._later:
                first, when = "", f"diverged at step {self._start}"
            seen = (
                f"perplexity up to {self._ppl:.3g} on every one of the {self._count} records "
                f"since step {self._start}{first}{outcome}: above V^1.25 for V = "
                f"{self._vocab:.0f} tokens ({what}), worse than a uniform guess over them: the "
                f"run {when}"
            )
        evidence = {} if self._ppl and not grad else {"grad_norm": grad}
        evidence["records"] = float(self._count)
        if self._ppl:
            evidence["ppl"] = self._ppl
        if loss:
            evidence["loss"] = loss
        return Finding(
            kind=DIVERGED,
            step=self._start,
            end_step=self._end,
            severity=Severity.ERROR,
            seen=seen,
            evidence=evidence,
            remedies=kind_of(DIVERGED).remedies,
            advice="go back to a checkpoint from before it diverged, with a lower LR",
        )

    def finish(self) -> list[Finding]:
        if self.done:
            return []
        self.done = True
        if not self._reported and self._count >= _WHOLE and not (self._by_level or self._later):
            # An excerpt whose every record has a gradient norm out of all proportion, fewer than
            # `records` of them: nothing in it says the run was ever in range (mmdetection#3446:
            # 3.8e12, 4.1e10 beside losses of 6e4, 2e4). The bounds by level are nearer healthy
            # runs (a regression's excerpt): they keep waiting for `records`.
            return [self._finding(", to the end of the log")]
        grew = self._reported and self._count > self._reported
        return [self._finding(", to the end of the log")] if grew else []

    def state_dict(self) -> dict[str, Any]:
        return {
            "judging": not self.done,
            "first": self._first,
            "begins": self._begins,
            "by_level": self._by_level,
            "start": self._start,
            "end": self._end,
            "count": self._count,
            "reported": self._reported,
            "worst": list(self._worst),
            "ppl": self._ppl,
            "vocab": self._vocab,
            "later": self._later,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.done = not state["judging"]
        self._first = state.get("first")
        self._begins = state.get("begins")
        self._by_level = bool(state.get("by_level", False))
        self._start = None if state["start"] is None else int(state["start"])
        self._end, self._count = int(state["end"]), int(state["count"])
        self._reported = int(state["reported"])
        grad, loss = state["worst"]
        self._worst = (float(grad), float(loss))
        self._ppl = float(state.get("ppl", 0.0))
        self._vocab = float(state.get("vocab", _LARGEST))
        self._later = bool(state.get("later", False))


def _vocabulary(stated: float | None) -> float:
    """The V of `BEYOND_CHANCE`: the vocabulary the log states, else the largest we know."""
    return stated if stated is not None and stated >= 2 else _LARGEST


def _beyond_chance(ppl: float, stated: float | None) -> bool:
    """A perplexity whose log is `BEYOND_CHANCE` times ln V or more; NaN and Inf are not (a
    non-finite loss is `NonFinite`'s)."""
    if not (math.isfinite(ppl) and ppl > 1.0):
        return False
    return math.log(ppl) >= BEYOND_CHANCE * math.log(_vocabulary(stated))


def _out_of_proportion(grad: float, loss: float | None) -> bool:
    """A gradient norm beyond any healthy run's, whatever its loss's scale; NaN is not
    (`NonFinite`'s)."""
    if not math.isfinite(grad) or grad < GRAD_ALONE:
        return False
    return loss is None or not math.isfinite(loss) or grad >= OUT_OF_PROPORTION * abs(loss)


def _out_of_range(grad: float, loss: float | None) -> bool:
    """A gradient norm and a loss beyond any healthy language or vision model's (see the
    bounds): in an excerpt, a run that had diverged before it began."""
    if not math.isfinite(grad) or grad < GRAD_WITH_LOSS:
        return False
    return loss is not None and math.isfinite(loss) and loss >= LOSS_WITH_GRAD
