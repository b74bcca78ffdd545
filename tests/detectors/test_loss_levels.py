"""LossSpike on the shapes of issues #31-#33: a jump that stays up after a resume, a glitch of
interval-averaged losses, an LR too high from the first step, and levels the run made itself
(a new stage, an LR restart, a loss term that starts after a warm-up of zeros).

Every stream is a literal list of what the log prints (or a few lines that build one), and the
docstring says what a person reading it sees.
"""

from __future__ import annotations

import math
import random

import pytest

from stabilizer.core.detectors import LossSpike
from stabilizer.core.detectors._level import RunChanges, falls
from stabilizer.core.records import Finding, Severity, StepRecord

from .streams import feed, records


def _kinds(found: list[Finding]) -> list[tuple[str, int, Severity]]:
    return [(f.kind, f.step, f.severity) for f in found]


# BigScience tr8b-104B, chronicles.md, Embed-Norm Experiment 7: the resume at iteration 17060.
TR8B_RESUME = [
    2.665295,
    2.667121,
    4.374269,
    4.365822,
    4.391485,
    4.404639,
    4.398458,
    4.096038,
    4.137348,
]


def test_a_jump_that_stays_up_after_a_resume_is_a_divergence() -> None:
    """2.67, 2.67, then 4.37-4.40 for five iterations and 4.1 after: 1.6x, under a short
    excerpt's doubling, but it stays up: the divergence right after a resume (#32 class 7)."""
    [found] = feed(LossSpike(), records("loss", TR8B_RESUME, start=17060))
    assert (found.kind, found.severity, found.step, found.end_step) == (
        "divergence",
        Severity.ERROR,
        17062,
        17068,
    )
    assert found.seen == (
        "loss diverged at step 17062: 4.137 against its 2.666 start and never got back to where "
        "it started"
    )


def test_a_jump_under_a_doubling_that_falls_back_says_nothing() -> None:
    """The same 1.6x jump on two records, back at once: one noisy record of a short excerpt."""
    assert feed(LossSpike(), records("loss", [2.665, 2.667, 4.37, 2.66, 2.67, 2.66])) == []


# BigScience tr8-104B-wide, chronicles.md: "we went from 6.3 to 9", 10-iteration averages.
TR8_RAMP = [6.365808, 6.598378, 7.314456, 9.121927, 10.23865]


def test_an_averaged_loss_rising_record_after_record_is_a_spike_under_way() -> None:
    """Megatron averages the loss over the log interval, so one bad iteration is a ramp: 6.37,
    6.60, 7.31, 9.12, 10.24, 1.6x where the rise began and still climbing at the end."""
    [found] = feed(LossSpike(), records("loss", TR8_RAMP, start=690))
    assert (found.kind, found.step, found.severity) == ("loss_spike", 694, Severity.WARNING)
    assert found.evidence["baseline"] == TR8_RAMP[0]
    assert "up until the end of the log" in found.seen


def test_a_rise_of_a_few_percent_record_after_record_is_no_spike() -> None:
    assert feed(LossSpike(), records("loss", [2.30, 2.31, 2.35, 2.38, 2.41, 2.45])) == []


def _glitch(bump: list[float], seed: int = 0) -> list[float]:
    """A smooth interval-averaged loss (2.2, ±0.3% a record, falling slowly) with ``bump`` added
    from record 300 on."""
    rng = random.Random(seed)
    losses = [2.4 - 0.0005 * i + rng.gauss(0.0, 0.006) for i in range(400)]
    return [
        v + (bump[i - 300] if 300 <= i < 300 + len(bump) else 0.0) for i, v in enumerate(losses)
    ]


def test_a_glitch_of_a_smooth_loss_that_lasts_and_comes_back_is_a_spike() -> None:
    """+0.35 for four records on a loss that moves 0.006 a record: under the 1.5x / +0.5 bar of
    noisy losses, but 60 sigma of this run's own spread: the glitch a person sees at once."""
    [found] = feed(LossSpike(), records("loss", _glitch([0.3, 0.4, 0.38, 0.3])))
    assert (found.kind, found.step, found.end_step) == ("loss_spike", 300, 303)
    assert found.evidence["recovered"] == 1.0


@pytest.mark.parametrize(
    "bump",
    [[0.35], [0.15, 0.16, 0.15], [0.3] * 200],
    ids=["one-record", "seven-percent", "a-new-level-that-lasts"],
)
def test_a_one_record_glitch_a_small_one_or_a_lasting_shift_says_nothing(
    bump: list[float],
) -> None:
    assert feed(LossSpike(), records("loss", _glitch(bump))) == []


def _lr_too_high(start: int) -> list[float]:
    """#33 item 3: 3.5, then 46 at the next step, 15-37 for ~150 steps, then down to a plateau
    a healthy LR leaves in 50 steps (3.3)."""
    rng = random.Random(0)
    losses = [3.5012, 46.21] + [rng.uniform(15.0, 37.0) for _ in range(148)]
    losses += [3.3 + 8.7 * 0.8**i + rng.gauss(0.0, 0.03) for i in range(50)]
    return losses


@pytest.mark.parametrize("start", [0, 1], ids=["from-step-0", "from-step-1"])
def test_an_lr_too_high_from_the_first_step_is_a_run_that_never_learned(start: int) -> None:
    """The baseline is the first loss, not the blow-up: the loss diverged at the second step,
    sat far above its start for most of the run, and ends about where it started."""
    found = feed(LossSpike(), records("loss", _lr_too_high(start), start=start))
    assert _kinds(found) == [
        ("divergence", start + 1, Severity.ERROR),  # called 20 steps in
        ("divergence", start + 1, Severity.INFO),  # back, after most of the run (the episode
        # is an ERROR already: a live `auto` must not roll back because the loss came back)
        ("divergence", start + 1, Severity.ERROR),  # the end: never learned
    ]
    assert "sat far above it for" in found[1].seen and "most of the run was lost" in found[1].seen
    assert "the run never learned: its last loss" in found[2].seen
    assert "is about where it started (3.501)" in found[2].seen
    assert found[1].remedies[0] == "scale_lr"


def test_an_lr_too_high_from_the_first_step_that_stays_up_never_got_back() -> None:
    losses = _lr_too_high(1)[:150]
    called, closing = feed(LossSpike(), records("loss", losses, start=1))
    assert (called.kind, closing.kind, closing.severity) == (
        "divergence",
        "divergence",
        Severity.ERROR,
    )
    assert closing.seen.endswith("never got back to where it started")


def test_a_spacy_table_whose_first_row_is_one_batch_is_no_divergence() -> None:
    """spaCy's row at step 0 is one batch's loss, the next rows sums over 200 steps: 40, then
    2163, 1182, 1150, 1087, 1343. Step 0 alone, followed by a record steps later, is no
    baseline; step 0 followed by step 1 is one (the test above)."""
    stream = [
        StepRecord(step, {"loss": loss})
        for step, loss in zip(
            (0, 200, 400, 600, 800, 1000),
            (40.0, 2163.45, 1182.04, 1150.09, 1087.27, 1343.08),
            strict=True,
        )
    ]
    assert feed(LossSpike(), stream) == []


def test_a_loss_identically_zero_before_is_no_baseline() -> None:
    """A warm-up with no supervised term (loss exactly 0 for 100 steps), then the loss starts
    at 2.8 and falls: never "diverged against a 0 baseline" (#31)."""
    losses = [0.0] * 100 + [0.5 + 2.3 * math.exp(-i / 200) for i in range(300)]
    assert feed(LossSpike(), records("loss", losses)) == []


def _two_stages(marked: bool, falls: bool = True, height: float = 0.7) -> list[StepRecord]:
    """Stage 1 falls to ~1.6; at step 300 the run starts on new data: the loss jumps to
    2.2 + ``height`` (2.9) and falls as usual towards 2.2, or (``falls`` False) stays there."""
    rng = random.Random(1)
    stream = []
    for step in range(600):
        if step < 300:
            loss = 1.6 + 0.8 * math.exp(-step / 80)
        else:
            top = 2.2 + height
            loss = 2.2 + height * math.exp(-(step - 300) / 60) if falls else top
        values = {"loss": loss * (1.0 + rng.gauss(0.0, 0.03))}
        if marked and step == 300:
            values["new_data"] = 1.0
        stream.append(StepRecord(step, values))
    return stream


def test_a_second_stage_on_new_data_that_falls_as_usual_is_no_divergence() -> None:
    """The live monitor marks the first step of a dataloader the run had not used (``new_data``):
    the loss jumps from 1.6 to 2.9 there and falls as usual: a new level, judged from there."""
    assert feed(LossSpike(), _two_stages(marked=True)) == []


def test_a_second_stage_without_its_mark_that_falls_as_usual_is_a_new_level() -> None:
    """The same curve in a log that does not say a stage began (one dataset holding both
    stages; a loss term switched on inside the step): the run was still learning, the loss
    jumped 1.8x and falls from there at least as fast for its level: a new level (#31; the harm
    benchmark's staged-internal and aux-term)."""
    assert feed(LossSpike(), _two_stages(marked=False)) == []


def test_an_unmarked_jump_whose_loss_holds_is_a_divergence() -> None:
    """Unmarked, a jump is a failure when the loss holds at its new level: it neither came
    back nor learns."""
    found = feed(LossSpike(), _two_stages(marked=False, falls=False))
    assert found and found[0].kind == "divergence" and found[0].step == 300


def test_a_loss_thrown_about_far_above_is_a_divergence_however_it_swings() -> None:
    """The ``diverge`` scenario's shape (an LR surged 3000x for good, seed 0): 2.4, then
    288-970 with no trend. Swings that large fall and rise by hundreds between records; a fall
    from one to the next is no learning."""
    rng = random.Random(0)
    stream = _two_stages(marked=False)[:300]
    stream += [StepRecord(300 + i, {"loss": rng.uniform(190.0, 970.0)}) for i in range(60)]
    found = feed(LossSpike(), stream)
    assert found and found[0].kind == "divergence" and found[0].step == 300


def test_a_new_task_far_above_its_old_level_learnt_at_the_usual_rate_is_a_new_level() -> None:
    """Issue #39: a jump the loss then falls from at the run's usual rate is a new level (a
    stage, a task), whatever its size: 1.6 -> 14.2 (8.9x), learnt down from there record after
    record (the harm benchmark's new-task-internal: a classifier relabelled, 0.09 -> 7.35). It
    was a divergence past 4x before #39."""
    assert feed(LossSpike(), _two_stages(marked=False, height=12.0)) == []


def test_a_new_stage_whose_loss_does_not_fall_is_still_a_divergence() -> None:
    """Marked, but the loss holds at its new level (2.9) instead of falling: whatever the run
    changed, a loss that stays far above is a failure."""
    found = feed(LossSpike(), _two_stages(marked=True, falls=False))
    assert found and found[0].kind == "divergence" and found[0].severity is Severity.ERROR


def _sgdr(with_lr: bool) -> list[StepRecord]:
    """SGDR's warm restarts every 200 steps: the LR jumps back to its first peak (1e-3) and the
    loss jumps by 0.6 and falls back over ~50 steps."""
    rng = random.Random(2)
    stream = []
    for step in range(1000):
        cycle = step % 200
        lr = 1e-3 * 0.5 * (1.0 + math.cos(math.pi * cycle / 200)) + 1e-6
        bump = 0.6 * math.exp(-cycle / 15) if step >= 200 else 0.0
        loss = (0.3 + 1.5 * math.exp(-step / 100) + bump) * (1.0 + rng.gauss(0.0, 0.03))
        stream.append(StepRecord(step, {"loss": loss, "lr": lr} if with_lr else {"loss": loss}))
    return stream


def test_warm_restarts_of_the_lr_are_no_spikes_or_divergences() -> None:
    assert feed(LossSpike(), _sgdr(with_lr=True)) == []


def test_the_same_jumps_without_the_lr_in_the_log_are_reported() -> None:
    assert feed(LossSpike(), _sgdr(with_lr=False))


def test_an_lr_surge_past_anything_the_run_used_is_no_restart() -> None:
    """The ``diverge`` scenario: the LR goes 3000x past its peak at step 150 and the loss jumps
    a hundredfold: no scheduler restarts there, it is a divergence."""
    rng = random.Random(3)
    stream = [
        StepRecord(
            s,
            {
                "loss": (2.5 if s < 150 else 250.0) * (1 + rng.gauss(0, 0.03)),
                "lr": 3e-4 if s < 150 else 0.9,
            },
        )
        for s in range(300)
    ]
    found = feed(LossSpike(), stream)
    assert found and found[0].kind == "divergence" and 150 <= found[0].step < 170


@pytest.mark.parametrize(
    ("lrs", "restart"),
    [
        ([1e-5 * i for i in range(1, 101)], None),  # a warm-up: a new highest LR every step
        ([1e-3, 5e-4, 1e-4, 1e-6, 1e-3], 4),  # SGDR: back to the first peak
        ([1e-3, 5e-4, 1e-4, 1e-6, 7e-4], 4),  # a restart to a decayed peak
        ([3e-4, 3e-4, 0.9, 0.9], None),  # a surge 3000x past anything used: no restart
        ([1e-3, 9e-4, 8e-4, 1e-3], None),  # a bump of 1.25x: no restart
    ],
    ids=["warm-up", "sgdr", "decayed-peak", "surge", "small-bump"],
)
def test_an_lr_restart_is_a_rise_back_to_a_level_the_run_used(
    lrs: list[float], restart: int | None
) -> None:
    changes = RunChanges()
    for step, lr in enumerate(lrs):
        changes.update(step, {"lr": lr})
    assert changes.step == restart
    assert bool(changes.since(0)) is (restart is not None)


def test_new_data_marks_the_step_the_run_started_on_it() -> None:
    changes = RunChanges()
    changes.update(7, {"new_data": 0.0})
    assert changes.step is None
    changes.update(8, {"new_data": 1.0})
    assert (changes.step, changes.since(8), changes.since(9)) == (
        8,
        "the run started on new data",
        "",
    )
    twin = RunChanges()
    twin.load(changes.state())
    assert twin.state() == changes.state()


@pytest.mark.parametrize(
    ("values", "usual", "expected"),
    [
        ([2.9, 2.8, 2.7, 2.6, 2.5, 2.4], 0.0, True),  # falls
        ([2.9, 2.9, 2.9, 2.9, 2.9, 2.9], 0.0, False),  # holds
        ([2.9, 2.91, 2.89, 2.9, 2.9, 2.91], 0.0, False),  # noise about a flat level
        ([2.9, 3.2, 3.5, 3.8, 4.1, 4.4], 0.0, False),  # climbs
        ([2.9, 2.89, 2.88, 2.87, 2.86, 2.85], 0.05, False),  # falls, slower than usual
    ],
    ids=["falls", "holds", "flat-noise", "climbs", "slower-than-usual"],
)
def test_a_new_level_falls_at_its_usual_rate(
    values: list[float], usual: float, expected: bool
) -> None:
    assert falls(values, usual) is expected
