"""`LossSpike`: the loss jumps and comes back (spike), or jumps and stays up (divergence)."""

from __future__ import annotations

from math import isfinite
from typing import Any, ClassVar

from stabilizer.core.records import Finding, StepRecord
from stabilizer.core.signals import LOSS, LR, NEW_DATA

from . import _loss_words as words
from ._excerpt import climbing, short_spike, stays
from ._level import RunChanges, ends_far, fall_rate, made_new_level
from ._regime import Early, Regime, never_back
from ._robust import RobustWindow, SpikeTracker
from .base import check_at_least

__all__ = ["LossSpike"]

_HOLD = 0.5  # a loss that keeps this share of its recent excess is not falling back
_KEEP = 64  # losses of an open episode kept (to tell whether a new level falls)
_LEARNED = 0.9  # a run that ends above this share of its first loss learned nothing
_FROM_START = 2  # a jump with at most this many records before it blew up where the log starts


class LossSpike:
    """Loss spikes that recover, and loss jumps that stay up (divergence).

    Requires: ``loss``; ``lr`` and ``new_data`` where logged (changes the run made itself).
    Rule: loss > med + k·max(σ, rel_floor·|med|) and ≥ min(min_ratio·med, med + min_jump) once
    `min_history` losses are in the baseline (or, for a smooth loss, ≥ med + glitch·med for two
    records), ≥ short_ratio·med before (≥ min_ratio·med if it stays up, or from where a rise
    began); reported when it comes back if it rose `tail_ratio`× the largest rise of the last
    `memory` records; a divergence when still up after `settle_steps` steps and `settle_records`
    records, unless the run changed itself there and the loss then falls at its usual rate.

    Here med and σ (MAD-based) are those of the last `window` finite losses before the spike,
    frozen while it lasts, so that a spike cannot raise its own bar; a pasted excerpt is judged
    from its second record on (``baseline_records`` in the evidence). A spike is one
    ``loss_spike`` (WARNING) when the loss is back under ``med + recover_k·max(σ,
    rel_floor·|med|)``: only its end tells a spike from a divergence. A jump that stays up and
    does not fall back (it keeps half its largest excess) is a ``divergence`` (ERROR), emitted at
    once (a live monitor rolls back on it); a second finding with the same start closes it: INFO
    where the loss came back (saying so where it sat up there for most of the log; an ERROR
    "never learned" follows at the end where that began at the log's start and the loss ends
    about where it started), ERROR "until the end of the log" when the stream ends first.
    Non-finite losses are skipped (`NonFinite` reports them). Each rule with the log that shows
    it: docs/findings.md.

    Why these defaults, and not those of other tools:

    - Lightning's ``SpikeDetection`` flags loss ≥ 3× the mean of the last 10 losses. A mean is
      dragged up by the spike itself, and early in training, when the loss falls fast, ten steps
      span a large drop, so both the bar and the noise are wrong there. A median over 50 steps
      ignores up to 25 outliers and, on a falling curve, lies above the current loss: no false fire.
    - OLMo-core flags mean + 6σ over 128 steps. During the early fall σ measures the trend, not
      the noise, and inflates: a moderate spike (2.5 → 5) hides under it. MAD measures the noise.
    - k = 6 on a MAD σ: minibatch noise of ±5-10% never reaches 6σ, while 2.5 → 5 clears it. The
      floor ``rel_floor = 0.05`` keeps a near-constant loss (σ ≈ 0) from firing on a 1% wobble.
      The jump test (≥ 1.5× or ≥ +0.5 nats) keeps tiny, very smooth losses from firing on noise.
    - A MAD does not see a heavy tail: a 1B model's per-step loss jumps 1.4× every few hundred
      steps. A spike no larger than twice the run's recent rises is its regime, folded into the
      spike reported last (`Regime`): one episode per regime, not one per batch.
    - 20 steps and 5 records to call a divergence: a spike from one bad batch is back within a
      few steps; the loss of a run thrown into a worse region stays up. Calling it late costs the
      rollback what the run learns meanwhile. Five records, not three: a glitch of a log that
      prints every 10 steps lasts a few records and comes back (a spike, not a divergence).

    Args:
        window: Number of recent finite losses in the baseline.
        min_history: Losses in the baseline from which the long-log rule applies.
        k: Spike threshold in robust standard deviations.
        rel_floor: Lower bound of the standard deviation, relative to the median.
        min_ratio: Long logs: a spike is at least this multiple of the baseline...
        min_jump: ...or at least this many nats above it (whichever is smaller).
        short_ratio: Short excerpts: a spike is at least this multiple of the baseline.
        recover_k: Recovered when the loss is within this many standard deviations of the baseline.
        settle_steps: Steps a spike may last before it counts as a divergence...
        settle_records: ...and records (for logs that print every N steps).
        tail_ratio: Long logs: a spike rises at least this multiple of the run's largest rise...
        memory: ...over this many records.
        glitch: Long logs: a smooth loss's glitch rises at least this share of the median.
    """

    name: ClassVar[str] = "loss_spike"
    requires: ClassVar[tuple[str, ...]] = (LOSS,)

    def __init__(
        self,
        window: int = 50,
        min_history: int = 20,
        k: float = 6.0,
        rel_floor: float = 0.05,
        min_ratio: float = 1.5,
        min_jump: float = 0.5,
        short_ratio: float = 2.0,
        recover_k: float = 3.0,
        settle_steps: int = 20,
        settle_records: int = 5,
        tail_ratio: float = 2.0,
        memory: int = 2000,
        glitch: float = 0.1,
    ) -> None:
        self._tracker = SpikeTracker(window, self._classify)
        check_at_least("min_history", min_history, 2)
        if min_history > window:
            raise ValueError(f"`min_history` must be <= window ({window}), got {min_history}")
        for arg, value in (("k", k), ("rel_floor", rel_floor), ("min_jump", min_jump)):
            check_at_least(arg, value, 0.0)
        for arg, value in (("min_ratio", min_ratio), ("short_ratio", short_ratio)):
            check_at_least(arg, value, 1.0)
        check_at_least("tail_ratio", tail_ratio, 1.0)
        check_at_least("recover_k", recover_k, 0.0)
        if recover_k > k:
            raise ValueError(f"`recover_k` must be <= k ({k}), got {recover_k}")
        check_at_least("settle_steps", settle_steps, 1)
        check_at_least("settle_records", settle_records, 2)
        check_at_least("memory", memory, 1)
        check_at_least("glitch", glitch, 0.0)
        self.min_history, self.k, self.rel_floor = min_history, k, rel_floor
        self.min_ratio, self.min_jump, self.short_ratio = min_ratio, min_jump, short_ratio
        self.recover_k, self.tail_ratio, self.glitch = recover_k, tail_ratio, glitch
        self._glitch_bar = 1.0 + glitch
        self.settle_steps, self.settle_records = settle_steps, settle_records
        self._regime = Regime(memory)  # the run's recent rises over its median
        self._early = Early(min_history, tail_ratio)  # spikes of the first records, held
        self._first_records = True  # (`not self._early.done`, read every record)
        self._changes = RunChanges()
        self._records, self._last = 0, 0.0  # finite losses, the last one
        self._first: float | None = None  # the first finite loss
        self._started = False  # whether that loss is the run's start's (its step is 0 or 1)
        self._zero = False  # whether the log's first record is step 0's, the next steps later
        self._lost: dict[str, Any] | None = None  # the closing of a blow-up from the start
        self._kind = ""  # how `_classify` opened the last spike ("", "provisional", "rise")
        self._rise = 0.0  # the rise over its median of the loss `_classify` saw last
        self._band = 0.0  # the band of the glitch `_classify` opened last

    def _classify(self, loss: float, window: RobustWindow) -> tuple[float, float] | None:
        count = len(window.values)  # (the deque's own len: one Python call less a loss)
        self._kind, self._rise = "", 0.0
        if count < self.min_history:
            return self._short(loss, window) if count else None
        med = window.median()
        self._rise = loss - med
        if not (loss >= med + self.min_jump or (med > 0 and loss >= self.min_ratio * med)):
            # most losses: no jump, so no need to measure the noise; a glitch of a positive level
            return self._glitch(loss, med, window) if loss >= self._glitch_bar * med > 0 else None
        band = max(window.sigma(med), self.rel_floor * abs(med))
        if band <= 0.0:
            return None  # a level of exactly 0 with no spread is no baseline (#31)
        return (med, med + self.recover_k * band) if loss > med + self.k * band else None

    def _glitch(self, loss: float, med: float, window: RobustWindow) -> tuple[float, float] | None:
        """A jump under the long-log bar that is outsized for a smooth loss (interval-averaged
        Megatron losses: a 2.2 ± 0.01 loss at 2.6): `glitch`·|med| and k·σ above the median."""
        floor = self.glitch * med
        sigma = window.sigma(med)
        if loss < med + self.k * sigma:
            return None
        self._kind, self._band = "glitch", max(sigma, self.rel_floor * med)
        return med, med + 0.5 * floor

    def _short(self, loss: float, window: RobustWindow) -> tuple[float, float] | None:
        """`_classify` on a short excerpt (`_excerpt.short_spike`)."""
        if not self._early.done:
            self._rise = loss - window.median()  # (the first records' bumps: `Early`)
        lowest = window.ordered[0]
        start = self._first if self._started else None  # (the loss the run started from)
        if lowest > 0.0 and loss < self.min_ratio * lowest and (start is None or loss < start):
            return None  # most losses: under `min_ratio`x every baseline, and the run's start
        spike = short_spike(loss, window, self, start)
        if spike is None:
            return None
        self._kind = spike[2]
        return spike[0], spike[1]

    def update(self, record: StepRecord) -> list[Finding]:
        values = record.values
        lr = values.get(LR)
        if (lr is not None and lr != self._changes.lr) or NEW_DATA in values:
            self._changes.update(record.step, values)  # (an LR as before changes nothing)
        loss = values.get(LOSS)
        if loss is None or not isfinite(loss):
            return []
        tracker = self._tracker
        window = tracker.window
        ordered = window.ordered
        if len(ordered) > 1 and ordered[-1] != 0.0 and self._first is not None:
            self._records, self._last = self._records + 1, loss  # (`_count`, most records)
        else:
            self._count(record.step, loss, window)
        opened = tracker.episode
        self._rise = 0.0
        ended = tracker.observe(record.step, loss)
        if opened is None and tracker.episode is not None:
            tracker.episode["tail"] = self._regime.bumps.largest()  # the rises before it
        rise = loss - opened["baseline"] if opened is not None else self._rise
        self._regime.bumps.rises.append(rise)  # (`Bumps.push`, without its call: every record)
        if ended is not None or self._first_records:
            return self._settle(record.step, loss, rise, ended, opened is None)
        episode = tracker.episode
        if episode is None:
            return []
        if opened is None:
            self._open(episode, window)
        return self._follow(episode, loss, record.step)

    def _settle(
        self, step: int, loss: float, rise: float, ended: dict[str, Any] | None, fresh: bool
    ) -> list[Finding]:
        """`update` where an episode ended or the first records are not over (`Early`: note
        the record's rise; once the baseline is long enough, judge the spikes held)."""
        early, tracker = self._early, self._tracker
        if not early.done and len(early.rises) < early.keep:
            early.rises.append((step, rise))  # (`Early.note` without its call: the first records)
        found = [] if ended is None else self._ended(ended, step)
        if not early.done and len(tracker.window.values) >= self.min_history:
            found += self._release()
        episode = tracker.episode
        if ended is not None or episode is None:
            return found
        if fresh:
            self._open(episode, tracker.window)
        return found + self._follow(episode, loss, step)

    def _release(self) -> list[Finding]:
        """The first records are over: the held spikes that stand out of the run's own bumps."""
        self._first_records = False
        return [self._regime.report(words.spike(e, e["back"])) for e in self._early.release()]

    def _count(self, step: int, loss: float, window: RobustWindow) -> None:
        """Count a finite loss; start the baseline over after a loss that was identically 0;
        note whether the baseline's first record is step 0's alone (see `_excerpt.stays`)."""
        if window.values and window.ordered[-1] == 0.0 == window.ordered[0] and loss != 0.0:
            window.clear()  # the loss was identically 0: no baseline for the one that starts
        if not window.values and self._tracker.episode is None:
            self._zero = step == 0
        elif len(window.values) == 1 and step == 1:
            self._zero = False  # the next record is the next step: step 0 is a baseline
        self._records, self._last = self._records + 1, loss
        if self._first is None:
            self._first, self._started = loss, step <= 1

    def _open(self, episode: dict[str, Any], window: RobustWindow) -> None:
        """Note how a new episode was opened, and whether the run changed itself there."""
        if self._kind == "provisional" or episode["baseline_records"] < 2:
            episode["provisional"] = True
        if self._kind == "glitch":
            episode["glitch"] = self._band  # the band a jump must clear to be judged as one
        why = self._changes.since(episode["start"] - self.settle_steps)
        if why:
            episode["change"] = why
        before = list(window.values)
        episode["usual"] = fall_rate(before)

    def _follow(self, episode: dict[str, Any], loss: float, step: int) -> list[Finding]:
        """An open episode's new loss: drop a jump that did not stay up, let a new level the
        run made start a new baseline, call a divergence once settled."""
        tracker = self._tracker
        if episode.get("provisional") and "called" not in episode:
            if not stays(loss, episode, self, self._zero):
                tracker.episode = None
                tracker.window.push(loss)
                return []
            if episode["records"] >= self.settle_records:
                del episode["provisional"]
        if "glitch" in episode and self._jumped(loss, episode["baseline"], episode["glitch"]):
            del episode["glitch"]  # a glitch grown into a jump: judged as one
        episode["level"] = loss
        # New lists, not appends: `state` copies the episode shallowly.
        episode["recent"] = [*episode.get("recent", [])[1 - self.settle_records :], loss]
        episode["losses"] = [*episode.get("losses", [])[1 - _KEEP :], loss]
        if "called" in episode or not self._settled(episode):
            return []
        if "glitch" in episode:
            tracker.rebaseline(episode["recent"])  # a small shift that lasts: a new level
            return []
        if made_new_level(episode) or not self._outsized(episode):
            tracker.rebaseline(episode["recent"])  # a new level the run made: judged from there
            self._regime.new()
            return []
        episode["called"] = step
        return [words.divergence(episode, end_of_log=False, start_of_run=False)]

    def _outsized(self, episode: dict[str, Any]) -> bool:
        """Whether a jump that stayed up is outsized for the run's batch-to-batch noise: at
        once where the baseline is long (its MAD measured that noise); on a short one, if no
        loss since came back within the range of its few records (`never_back`)."""
        if episode["baseline_records"] >= self.min_history:
            return True
        return never_back(self._tracker.window.values, episode["losses"])

    def _jumped(self, loss: float, base: float, band: float) -> bool:
        """Whether ``loss`` clears the long-log bar over ``base`` and its ``band``."""
        jump = loss >= base + self.min_jump or (base > 0 and loss >= self.min_ratio * base)
        return jump and loss > base + self.k * band

    def _settled(self, episode: dict[str, Any], end_of_log: bool = False) -> bool:
        """Whether the loss has stayed up long enough, and is not on its way back down.

        A spike that decays over several records (5.7, 4.7, 3.8, 3.0 on a 2.05 baseline) is not
        a divergence: the loss must hold at least `_HOLD` of its largest excess over the baseline
        in the last `settle_records` records. At the end of the log the steps are not waited for.
        """
        if not end_of_log and episode["last"] - episode["start"] < self.settle_steps:
            return False
        if episode["records"] < self.settle_records:
            return False
        base: float = episode["baseline"]
        recent: list[float] = episode["recent"]
        return recent[-1] - base >= _HOLD * (max(recent) - base)

    def _ended(self, episode: dict[str, Any], step: int) -> list[Finding]:
        """The loss came back under the limit: the episode's closing finding, if any."""
        back = step - episode["start"]
        if "called" in episode:
            lost = 2 * episode["records"] > self._records  # up for most of the log
            closing = words.back(episode, step, lost)
            if lost and episode["baseline_records"] <= _FROM_START:
                self._lost = closing.to_dict()  # the run blew up where the log starts
            return [closing]
        if episode.get("provisional") or "change" in episode:
            return []  # a jump that did not stay up; a level the run made and left again
        if "glitch" in episode and episode["records"] < 2:
            return []  # a glitch must last: one record of a smooth loss may be one batch
        if not self._early.done and episode["baseline_records"] < self.min_history:
            self._early.hold(episode, back)  # the run's first records: judged by its own bumps
            return []
        rise = episode["peak"] - episode["baseline"]
        if episode["baseline_records"] >= self.min_history and rise < self.tail_ratio * episode.get(
            "tail", 0.0
        ):
            self._regime.fold(episode["last"])  # no larger than the run's recent rises
            return []
        return [self._regime.report(words.spike(episode, back))]

    def finish(self) -> list[Finding]:
        found = self._release() if not self._early.done else []
        found += self._close(self._tracker.close())
        folded = self._regime.close()
        if folded is not None:
            found.insert(0, folded)
        lost, first, self._lost = self._lost, self._first, None
        if lost is not None and first is not None and first > 0 and self._last >= _LEARNED * first:
            found.append(words.never_learned(Finding.from_dict(lost), first, self._last))
        return found

    def _close(self, episode: dict[str, Any] | None) -> list[Finding]:
        """End of the log: the open episode's finding."""
        if episode is None:
            return []
        start_of_run = episode["baseline_records"] <= _FROM_START
        if "called" in episode:
            return [words.divergence(episode, end_of_log=True, start_of_run=start_of_run)]
        if made_new_level(episode):
            return []
        if ends_far(episode) or (
            episode["records"] >= self.settle_records and self._settled(episode, end_of_log=True)
        ):
            return [words.divergence(episode, end_of_log=True, start_of_run=start_of_run)]
        if episode.get("provisional") and not climbing(episode, self.min_ratio):
            return []  # a jump that must stay up, and had stopped climbing: not yet
        if "glitch" in episode or "change" in episode:
            return []  # a glitch that must come back; a level the run made and left: not yet
        return [words.spike(episode, back_after=None)]

    def restart(self) -> None:
        """Training restarted from earlier weights: its baseline starts over (`Engine.restart`)."""
        self._tracker.restart()

    def state_dict(self) -> dict[str, Any]:
        run: dict[str, Any] = {"records": self._records, "first": self._first}
        run.update(last=self._last, zero=self._zero, lost=self._lost, started=self._started)
        return {
            **self._tracker.state(),
            "regime": self._regime.state(),
            "changes": self._changes.state(),
            "early": self._early.state(),
            "run": run,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Earlier rounds' checkpoints have none of these but the tracker's (and a "zero" flag).
        self._regime.load(state.get("regime"))
        self._changes.load(state.get("changes"))
        self._early.load(state.get("early"))
        self._first_records = not self._early.done
        run = state.get("run", {})
        self._records, self._first = int(run.get("records", 0)), run.get("first")
        self._last = float(run.get("last", 0.0))
        self._zero, self._lost = bool(run.get("zero", state.get("zero"))), run.get("lost")
        self._started = bool(run.get("started", False))
        self._tracker.load(state)
