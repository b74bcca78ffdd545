"""`Stall`: a run that never learns: its loss still where it started after the first steps, or
flat at chance level (ln of a vocabulary or class count) at any step."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from stabilizer.core.kinds import STALL, kind_of
from stabilizer.core.records import Finding, Severity, StepRecord
from stabilizer.core.signals import GRAD_NORM, LOSS, LR, VOCAB_SIZE

from ._chance import RECORDS, ChanceWatch, near_some
from ._robust import median
from ._trend import Trend
from .base import check_at_least, check_fraction

__all__ = ["FrozenWatch", "Stall", "digits"]

_SAMPLE = 5  # losses whose median stands for the start, and for the level now
_MIN_RECORDS = 10  # fewer losses by the decision are too few to call a run stalled
_LOW = 20  # the losses whose median says how low the loss has been (noise averages out)
_MIN_FALL = 0.01  # of the start: a fall the trend must add up to, to count as learning
_ZERO_RECORDS = 8  # records in a row with a gradient norm of exactly 0 that decide at once
_FROZEN_RECORDS = 6  # records in a row at different steps with the same loss: frozen
_FROZEN_DIGITS = 6  # significant digits a loss must be printed with for its repeats to count
_SAME = 1e-6  # relative: the same loss to its sixth digit (an fp32 mean's last bits differ)


class Stall:
    """A run that never learns: the loss stays where it started, or at chance level.

    Requires: ``loss``; ``lr`` and ``vocab_size`` when logged.
    Rule: at step `steps` or later (after any LR warm-up), once 10 losses are in, the median of
    the last 5 losses, and the median of every 20 consecutive losses so far, have stayed within
    `tolerance` of the first 5 (or of ln(`vocab_size`) when known), while the LR is non-zero,
    and the losses of the last two thirds of those steps are not falling (their least-squares
    slope is not 2 standard errors below 0, or adds up to less than 1% of the start: a run that
    learns slowly is not a stall) and surely flat: a line 2 standard errors steeper than theirs
    would not fall by `tolerance` over them (too few or too noisy losses: not yet, looked at
    again with twice the losses). A loss that
    fell and came back up is a divergence (`LossSpike`'s), not a stall.
    Rule (chance level, at any step): 8 losses in a row flat at ln(N), the loss of a uniform
    guess over N outputs: a common tokenizer size within 1%, a round class count (10, 100, 1000)
    within 0.2%, the vocabulary the log states within 1%; at the start of training, before step
    `steps`, within 0.05% (`_chance`); with no fall from the first four to the last four, while
    the LR (when logged) is non-zero.

    A language model at initialisation predicts about uniformly: its loss is ln(vocab) (5.55 for
    bytes, 10.8 for GPT-2's 50k tokens), and any model that learns leaves it within a few hundred
    steps. A loss that has not moved by then means the updates do nothing useful: an LR far too
    high (the loss bounces back to chance) or far too low, frozen parameters, labels that do not
    match the inputs. Healthy runs may sit on a plateau at the start (a from-scratch LM at ln(vocab)
    for its first ~100 steps, while the LR warms up), so the check waits `steps` steps, and for the
    LR to stop rising when it is logged; a plateau that ends before then is not a stall. The check
    runs once, and only on a stream that starts at the beginning of training (its first step
    within the first quarter of `steps`): a resumed run or an excerpt from mid-run is not judged.
    One ``stall`` (WARNING) from the first step to the step of the decision.

    No gradient, no learning: where the gradient norm is exactly 0 on 8 records in a row and the
    loss does not fall over them (with a non-zero LR, when logged), nothing reaches the weights,
    and the start rule decides there instead of waiting for step `steps` (two OLMo runs whose
    embeddings got no gradient: the loss at 10.3 and 9.6 from step 10 to 180). Only at the start
    of a run: mid-run, a printed norm of 0.000 beside a loss far below its start is the trainer
    not computing it (Megatron-DeepSpeed prints ``grad norm: 0.000`` at every iteration).

    Frozen, at any step: a loss the same to its last printed digit on 6 records in a row at
    different steps (`FrozenWatch`), while the LR (when logged) is non-zero, away from every
    chance level (there the chance rule says why it is stuck).

    Chance level needs no start in view: a model whose loss is ln(N) to the second or third digit,
    record after record, gives every token or class the same probability whatever the input, at
    step 40 as at step 40,000. Each such stretch is one ``stall`` (WARNING) from its first record
    on; then the start rule has nothing more to say.

    Args:
        steps: Steps of training after which a loss still at its start is a stall.
        tolerance: How far below the start (a fraction of it) still counts as "at the start".
        vocab_size: The model's vocabulary size, when known: chance level is ln(vocab_size).
    """

    name: ClassVar[str] = "stall"
    requires: ClassVar[tuple[str, ...]] = (LOSS,)

    def __init__(
        self, steps: int = 300, tolerance: float = 0.1, vocab_size: int | None = None
    ) -> None:
        check_at_least("steps", steps, 1)
        check_fraction("tolerance", tolerance)
        if vocab_size is not None:
            check_at_least("vocab_size", vocab_size, 2)
        self.steps, self.tolerance, self.vocab_size = steps, tolerance, vocab_size
        self._done = False  # decided (or not the start of a run): nothing more to do
        self._first_step: int | None = None
        self._first: list[float] = []  # the first losses
        self._last: deque[float] = deque(maxlen=_SAMPLE)  # the latest losses
        self._recent: deque[float] = deque(maxlen=_LOW)
        self._lowest = math.inf  # the lowest median of `_LOW` consecutive losses so far
        self._look = _MIN_RECORDS  # losses at which the start rule decides next (more: again)
        self._count = 0  # finite losses counted by the start rule
        self._losses = 0  # finite losses seen
        self._lr: float | None = None  # the latest LR
        self._rising = False  # whether the LR rose since the record before: warm-up
        self._stated: float | None = None  # the vocabulary the log states
        self._chance = ChanceWatch()
        self._trend = Trend()  # the least-squares line through the losses before the decision
        self._zero = Trend()  # the same, through the losses of a stretch of zero gradient norms
        self._frozen = FrozenWatch()

    def update(self, record: StepRecord) -> list[Finding]:
        values = record.values
        self._note(values)
        loss = values.get(LOSS)
        if loss is None or not math.isfinite(loss):
            return []
        self._losses += 1
        if self._first_step is None:
            self._first_step = record.step
            self._done = record.step > self.steps // 4  # the start of training is not in view
        if self._lr != 0.0 and not self._chance.silenced:
            found = self._frozen.update(record.step, loss)
            if found and not near_some(loss, self._stated or self.vocab_size):
                self._done = self._chance.silenced = True  # (the other rules: nothing to add)
                return found  # (at a chance level, the chance rule says more: why it is stuck)
        if not self._done:
            found = self._from_start(record.step, loss, values.get(GRAD_NORM))
            if found:  # a stall from the first step on: one report is enough
                self._chance.silenced = True
                return found
        chance = self._chance
        if self._lr == 0.0 or chance.silenced:
            return []
        stated = self._stated or self.vocab_size
        if chance.open is None and not chance.recent and not near_some(loss, stated):
            return []  # (most losses: far from every chance level)
        return self._at_chance(record.step, loss, values.get(GRAD_NORM), stated)

    def _at_chance(
        self, step: int, loss: float, norm: float | None, stated: float | None
    ) -> list[Finding]:
        """The chance rule on one finite loss near a chance level (with the gradient norm beside
        it, if logged)."""
        if self._rising and norm != 0.0:
            return []  # a warm-up: the loss may wait at chance until the LR is up (not at 0 grad)
        chance = self._chance
        start = not self._done and step < self.steps
        steady = self._lr is not None and not self._rising  # (an LR of 0 returned above)
        found = chance.update(step, loss, stated, start, steady)
        self._done = self._done or bool(found)  # (at chance level: the start rule adds nothing)
        return found

    def _from_start(self, step: int, loss: float, norm: float | None) -> list[Finding]:
        """The start rule: count ``loss``; at step `steps`, decide (once); earlier where no
        gradient reaches the weights (``norm``, the gradient norm beside it)."""
        if len(self._first) < _SAMPLE:
            self._first.append(loss)
        self._last.append(loss)
        if step >= self.steps // 3:
            self._trend.add(
                loss
            )  # (the last two thirds: a loss that still falls, not one that fell)
        self._count += 1
        self._recent.append(loss)
        if len(self._recent) == _LOW:
            self._lowest = min(self._lowest, median(self._recent))
        if norm == 0.0 and self._lr != 0.0:
            self._zero.add(loss)
        elif self._zero.n:
            self._zero = Trend()
        if self._zero.n >= _ZERO_RECORDS and self._count >= _MIN_RECORDS:
            reference = median(self._first)
            if not self._zero.falling(_MIN_FALL * reference):
                self._done = True
                return self._decide(step, zero=self._zero.n) or []
        if step < self.steps or self._count < self._look or self._rising:
            return []  # (a log that prints every 100 steps: the 10th loss, not step 300, decides)
        found = self._decide(step)
        self._done = found is not None  # (None: not surely flat)
        self._look = 2 * self._count  # (not surely flat: looked at again with twice the losses)
        return found or []

    def _note(self, values: Mapping[str, float]) -> None:
        """Note a record's LR and the vocabulary it states."""
        lr = values.get(LR)
        if lr is not None:
            if lr == self._lr:
                self._rising = False  # (`_note_lr` of an LR as before)
            else:
                self._note_lr(lr)
        if VOCAB_SIZE in values:
            self._stated = values[VOCAB_SIZE]

    def _note_lr(self, lr: float) -> None:
        if math.isfinite(lr):
            self._rising = self._lr is not None and lr > self._lr
            self._lr = lr

    def _decide(self, step: int, zero: int = 0) -> list[Finding] | None:
        """The start rule's decision at ``step`` (``zero``: records in a row, up to it, with a
        gradient norm of exactly 0); None while the losses are too few, or too noisy, to rule
        out that the run learns (their line may still fall by `tolerance`): no decision yet."""
        assert self._first_step is not None
        start, level = median(self._first), median(self._last)
        chance = math.log(self.vocab_size) if self.vocab_size else None
        reference = start if chance is None else min(start, chance)
        if reference <= 0.0 or self._lr == 0.0 or self._count < _MIN_RECORDS:
            return []  # a loss at zero has nothing left to learn (or is not a likelihood)
        again = self._look > _MIN_RECORDS  # (weighed again and again, 5 noisy losses would dip)
        now = self._lowest if again else min(level, self._lowest)
        if now < (1.0 - self.tolerance) * reference:
            return []  # it learned (and maybe came back up: a divergence, not a stall)
        if self._trend.falling(_MIN_FALL * reference):
            return []  # it learns, slowly: a fine-tune at 2.12 -> 2.00 by step 300 is no stall
        if not zero and self._trend.may_fall(self.tolerance * reference, _spread(self._recent)):
            return None  # too few losses, or too noisy, to rule out that it learns: wait
        where = f"where it started ({start:.4g})"
        if chance is not None:
            where += f", chance level ln({self.vocab_size}) = {chance:.4g}"
        lr = "" if self._lr is None else f" while the LR is {self._lr:.3g}"
        if zero:  # (what stops it: nothing reaches the weights)
            lr += f", with a gradient norm of exactly 0 on the last {zero} records"
        evidence = {"start": start, "level": level, "steps": float(step - self._first_step)}
        if zero:
            evidence["zero_grad_records"] = float(zero)
        if chance is not None:
            evidence["chance"] = chance
        if self._lr is not None:
            evidence["lr"] = self._lr
        finding = Finding(
            kind=STALL,
            step=self._first_step,
            end_step=step,
            severity=Severity.WARNING,
            # (its advice stays in what was seen: the remedy says "the LR", not the rest)
            seen=f"loss still {level:.4g} at step {step}, {where}{lr}: the run is not learning; "
            "check the LR (far too high or too low), frozen parameters and the labels",
            evidence=evidence,
            remedies=kind_of(STALL).remedies,
        )
        return [finding]

    def finish(self) -> list[Finding]:
        chance = self._chance
        short = self._first_step is not None and self._first_step >= self.steps
        if short and not chance.silenced and self._losses == len(chance.recent) < RECORDS:
            return chance.whole_log(self._stated or self.vocab_size)
        return chance.finish()

    def state_dict(self) -> dict[str, Any]:
        return {
            "done": self._done,
            "first_step": self._first_step,
            "first": list(self._first),
            "last": list(self._last),
            "lr": self._lr,
            "rising": self._rising,
            "recent": list(self._recent),
            "lowest": None if math.isinf(self._lowest) else self._lowest,
            "look": self._look,
            "count": self._count,
            "losses": self._losses,
            "stated": self._stated,
            "chance": self._chance.state_dict(),
            "trend": self._trend.state(),
            "zero": self._zero.state(),
            "frozen": self._frozen.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._done, self._first_step = bool(state["done"]), state["first_step"]
        self._first = [float(v) for v in state["first"]]
        self._last = deque((float(v) for v in state["last"]), maxlen=_SAMPLE)
        self._lr = None if state["lr"] is None else float(state["lr"])
        self._rising = bool(state["rising"])
        self._recent = deque((float(v) for v in state.get("recent", ())), maxlen=_LOW)
        lowest = state.get("lowest")
        self._lowest = math.inf if lowest is None else float(lowest)
        self._look = int(state.get("look", _MIN_RECORDS))
        self._count = int(state.get("count", len(self._first)))
        self._losses = int(state.get("losses", self._count))
        stated = state.get("stated")
        self._stated = None if stated is None else float(stated)
        self._trend = Trend()
        self._trend.load(state.get("trend"))  # absent in checkpoints of earlier rounds
        self._zero = Trend()
        self._zero.load(state.get("zero"))
        self._frozen = FrozenWatch()
        self._frozen.load_state_dict(state.get("frozen"))  # absent in earlier checkpoints
        self._chance = ChanceWatch()
        if "chance" in state:
            self._chance.load_state_dict(state["chance"])


def _spread(losses: Iterable[float]) -> float:
    """The robust standard deviation of ``losses`` (1.4826 MADs): their batch-to-batch noise,
    whatever spike or fall is among them."""
    values = list(losses)
    middle = median(values)
    return 1.4826 * median([abs(value - middle) for value in values])


def digits(value: float) -> int:
    """The significant digits of ``value`` as Python writes it (its shortest round trip):
    ``16.74222755432129`` has 16, ``11.875`` 5, ``2.0`` 1."""
    mantissa = repr(abs(value)).split("e", 1)[0]
    if "." in mantissa:
        mantissa = mantissa.rstrip("0")
    return len(mantissa.replace(".", "").strip("0"))


class FrozenWatch:
    """A frozen loss: the same value, to its last printed digit, record after record.

    A training loss is the mean over a batch (or an epoch) that changes from one record to the
    next; as long as the weights change, its sixth significant digit does too. When it repeats to
    the last digit printed over 6 records at different steps, nothing the optimizer does reaches
    the loss: the weights do not change (an LR of 0, frozen parameters, an optimizer not stepping)
    or the model's output no longer depends on them (a collapsed model: a contrastive loss stuck
    at one value, 74 rows of a Lightning CSV). Only values printed to 6 significant digits or more
    count: a loss printed to four or five (``1.8673``, Keras' ``0.6931``) or a bf16 loss
    (``11.875``: 8 bits of mantissa) repeats by chance in a healthy run, and so does a summary
    printed twice or a line every rank prints; no healthy real log repeats a loss of six digits
    or more more than three times.
    """

    def __init__(self) -> None:
        self.value: float | None = None  # the loss the stretch repeats
        self.first: int | None = None  # the step of its first record
        self.step: int | None = None  # the step of its last record
        self.count = 0  # its records

    def update(self, step: int, loss: float) -> list[Finding]:
        """One finite loss at ``step``: a ``stall`` where a stretch reaches `_FROZEN_RECORDS`."""
        value = self.value
        if value is not None and abs(loss - value) <= _SAME * abs(value):
            if step == self.step:
                return []  # the same step printed again: no new record
            self.step, self.count = step, self.count + 1
            if self.count == 2 and (value == 0.0 or digits(value) < _FROZEN_DIGITS):
                self.value = None  # too few digits to say anything: wait for another value
            elif self.count == _FROZEN_RECORDS:
                return [self._finding(step)]
            return []
        self.value, self.first, self.step, self.count = loss, step, step, 1
        return []

    def _finding(self, step: int) -> Finding:
        assert self.value is not None and self.first is not None
        return Finding(
            kind=STALL,
            step=self.first,
            end_step=step,
            severity=Severity.WARNING,
            seen=f"loss {self.value:.10g} on {_FROZEN_RECORDS} records in a row, steps "
            f"{self.first}-{step}, the same to 6 significant digits: nothing the optimizer "
            "does reaches the loss; check the LR, frozen parameters, an optimizer that does "
            "not step, and a model whose output no longer depends on its input",
            evidence={"level": self.value, "frozen_records": float(_FROZEN_RECORDS)},
            remedies=kind_of(STALL).remedies,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "first": self.first, "step": self.step, "count": self.count}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        state = state or {}
        value = state.get("value")
        self.value = None if value is None else float(value)
        self.first, self.step = state.get("first"), state.get("step")
        self.count = int(state.get("count", 0))
