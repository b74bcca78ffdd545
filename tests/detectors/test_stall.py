"""`Stall`: a run that never learns. Literal streams, and the reference GPT under a real Trainer."""

from __future__ import annotations

import math
import random

import pytest
import torch

from stabilizer.callbacks.demo.run import run_scenario
from stabilizer.callbacks.monitor import StabilityMonitor
from stabilizer.core.detectors import Stall, default_detectors
from stabilizer.core.engine import Engine
from stabilizer.core.records import Finding, Severity, StepRecord
from stabilizer.demo.config import GPTConfig
from stabilizer.demo.scenarios import Scenario

CHANCE = math.log(256)  # 5.545: a byte-level model that knows nothing


def _feed(detector: Stall, losses: list[float], lrs: list[float] | None = None) -> list[Finding]:
    found: list[Finding] = []
    for step, loss in enumerate(losses):
        values = {"loss": loss} if lrs is None else {"loss": loss, "lr": lrs[step]}
        found += detector.update(StepRecord(step, values))
    return found + detector.finish()


def test_a_loss_that_never_leaves_its_start_is_a_stall() -> None:
    losses = [5.55, 5.54, 5.56, 5.53] * 10  # 40 steps at chance level, LR 0.1 throughout
    [stall] = _feed(Stall(steps=30), losses, [0.1] * 40)
    assert (stall.kind, stall.step, stall.end_step, stall.severity) == (
        "stall",
        0,
        30,
        Severity.WARNING,
    )
    assert stall.message.startswith(
        "loss still 5.55 at step 30, where it started (5.55) while the LR is 0.1: the run is not "
        "learning"
    )
    assert stall.evidence["steps"] == 30.0


def test_a_fine_tune_that_learns_slowly_is_not_a_stall() -> None:
    """Issue #39, from our own runs: a fine-tune improving slowly (2.12, 2.00 at step 300, 1.57
    at step 3000) was called a stall, exit 1: its loss fell 6% by the decision, under the 10%
    tolerance, but it falls record after record. A flat loss with the same noise still stalls."""
    rng = random.Random(0)
    noise = [rng.gauss(0.0, 0.05) for _ in range(301)]
    slow = [2.12 - 0.12 * step / 300 + noise[step] for step in range(301)]
    assert _feed(Stall(), slow, [2e-5] * 301) == []
    [stall] = _feed(Stall(), [2.12 + n for n in noise], [2e-5] * 301)
    assert (stall.kind, stall.end_step) == ("stall", 300)


def test_a_plateau_that_ends_is_not_a_stall() -> None:
    # custom_llm_pretrain_ep_batch (reallogs): at ln(vocab) for 80 batches, then down.
    losses = [10.984375, 10.976562, 10.984375, 10.914062, 10.3125, 10.078125, 9.765625]
    losses += [9.601562, 9.398438, 9.109375, 8.898438, 8.6875, 8.390625]
    found: list[Finding] = []
    stall = Stall()
    for step, loss in zip(range(20, 280, 20), losses, strict=True):
        found += stall.update(StepRecord(step, {"loss": loss}))
    assert found + stall.finish() == []


def test_a_loss_that_fell_and_came_back_is_no_stall() -> None:
    # generic_failing.log's shape: learns 6.3 -> 2.6, then jumps back to 6.6 before step 300.
    losses = [6.3 - 0.2 * i for i in range(19)] + [6.6] * 21
    assert _feed(Stall(steps=30), losses, [3e-4] * 40) == []


def test_too_few_records_are_not_judged() -> None:
    # 7 records spread over the first steps (tests/fixtures/hostile/steps_past_int64.jsonl)
    found: list[Finding] = []
    stall = Stall(steps=30)
    for step in (0, 10, 20, 30, 40, 50, 60):
        found += stall.update(StepRecord(step, {"loss": 2.6, "lr": 0.1}))
    assert found + stall.finish() == []


def test_no_decision_while_the_lr_warms_up() -> None:
    lrs = [0.001 * (step + 1) for step in range(40)] + [0.04] * 5  # warm-up over 40 steps
    losses = [5.5] * 36 + [5.0, 4.6, 4.2, 4.0, 3.9, 3.8, 3.8, 3.7, 3.7]  # learns once the LR is up
    assert _feed(Stall(steps=10), losses, lrs) == []


def test_silent_when_the_lr_is_zero() -> None:
    assert _feed(Stall(steps=10), [5.5] * 20, [0.0] * 20) == []


def test_a_loss_at_zero_is_not_a_stall() -> None:
    assert _feed(Stall(steps=10), [0.0] * 20, [0.1] * 20) == []


def test_a_stream_from_mid_run_is_not_judged() -> None:
    found: list[Finding] = []
    stall = Stall(steps=100)
    for step in range(5000, 5300):
        found += stall.update(StepRecord(step, {"loss": 2.1}))
    assert found == []


def test_near_chance_level_counts_when_the_vocabulary_is_known() -> None:
    # A bad initialisation starts above chance (6.8); falling to chance is not learning.
    losses = [7.0, 6.9, 6.8, 6.7, 6.6] + [5.6] * 35
    assert _feed(Stall(steps=30), losses) == []
    [stall] = _feed(Stall(steps=30, vocab_size=256), losses)
    assert stall.evidence["chance"] == pytest.approx(CHANCE)
    assert "chance level ln(256) = 5.545" in stall.message


def test_state_round_trip_keeps_the_decision() -> None:
    first, second = Stall(steps=30), Stall(steps=30)
    for step in range(15):
        first.update(StepRecord(step, {"loss": 5.5, "lr": 0.1}))
    second.load_state_dict(first.state_dict())
    found: list[Finding] = []
    for step in range(15, 40):
        found += second.update(StepRecord(step, {"loss": 5.5, "lr": 0.1}))
    assert [f.step for f in found] == [0]


@pytest.mark.parametrize("steps", [0, -1])
def test_bad_steps_are_refused(steps: int) -> None:
    with pytest.raises(ValueError, match="`steps` must be >= 1"):
        Stall(steps=steps)


def _train(lr: float, warmup_steps: int) -> list[Finding]:
    """The reference GPT (tiny) for 40 steps under a real Trainer; the monitor's findings. On
    two torch threads, whatever the machine: at LR 1.0 the run stalls on two, and diverges on
    one (the threads' sums round differently), so the claim needs its thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return _train_on(lr, warmup_steps)
    finally:
        torch.set_num_threads(threads)


def _train_on(lr: float, warmup_steps: int) -> list[Finding]:
    model = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32)
    scenario = Scenario("tiny", "stall test", model=model, steps=40, batch_size=8, lr=lr)
    scenario = Scenario(**{**scenario.__dict__, "warmup_steps": warmup_steps})
    detectors = [d for d in default_detectors() if d.name != "stall"]
    monitor = StabilityMonitor(
        detectors=[*detectors, Stall(steps=20, vocab_size=256)], jsonl=False, preflight=False
    )
    run_scenario(scenario, callbacks=[monitor], accelerator="cpu", validate=False)
    return monitor.findings


def test_the_reference_gpt_at_a_far_too_high_lr_never_learns() -> None:
    """At LR 1.0 the loss is thrown far above chance and bounces back (5.5, 43, 20, 6.5):
    a divergence that never learned; or, where it only bounces about chance, a stall. A loss
    that noisy is no flat loss until enough records rule out a fall (`Trend.may_fall`)."""
    found = _train(lr=1.0, warmup_steps=0)
    stalls = [f for f in found if f.kind == "stall"]
    lost = [f for f in found if f.kind == "divergence" and f.evidence.get("never_learned")]
    assert stalls or lost
    assert all(f.evidence["level"] > 0.95 * CHANCE for f in stalls)


def test_the_reference_gpt_at_a_sound_lr_does_not_stall() -> None:
    assert [f for f in _train(lr=3e-3, warmup_steps=10) if f.kind == "stall"] == []


def test_the_default_engine_runs_stall() -> None:
    assert "stall" in [d.name for d in Engine().detectors]


# --- chance level, at any step (issue #32) -------------------------------------------------------


def _records(losses: list[float], first: int = 1000, every: int = 10) -> list[StepRecord]:
    return [StepRecord(first + every * i, {"loss": loss}) for i, loss in enumerate(losses)]


def _run(records: list[StepRecord], stall: Stall | None = None) -> list[Finding]:
    stall = stall or Stall()
    found = [f for record in records for f in stall.update(record)]
    return found + stall.finish()


def test_a_loss_flat_at_ln_vocab_mid_run_is_a_stall() -> None:
    """litgpt#689's shape: ``loss 10.8259`` on every iteration, ln(50304) (GPT-2's vocabulary
    padded): a uniform guess, at any step."""
    first, last = _run(_records([10.8259] * 23))
    assert (first.kind, first.step, first.end_step, first.severity) == (
        "stall",
        1000,
        1070,
        Severity.WARNING,
    )
    assert (last.step, last.end_step) == (1000, 1220)  # the same episode, to the end of the log
    assert first.evidence["outputs"] == 50304
    assert "ln(50304) = 10.826, the loss of a uniform guess over 50304 tokens" in first.message


@pytest.mark.parametrize(
    ("losses", "outputs"),
    [
        ([2.3030, 2.3030, 2.3029, 2.3029, 2.3029, 2.3029, 2.3028, 2.3029], 10),  # fractalnet
        ([4.6052] * 10, 100),  # CIFAR-100 in Keras
        ([6.9078, 6.9081, 6.9075, 6.9079] * 3, 1000),  # ImageNet
        ([10.37, 10.33, 10.36, 10.39, 10.41, 10.35, 10.37, 10.32], 32000),  # within 1%
        ([11.93, 11.95, 11.91, 11.94, 11.92, 11.96, 11.93, 11.94], 151936),  # Qwen
    ],
    ids=["cifar10", "cifar100", "imagenet", "llama", "qwen"],
)
def test_each_recognised_count(losses: list[float], outputs: int) -> None:
    [stall] = _run(_records(losses))[:1]
    assert stall.evidence["outputs"] == outputs


@pytest.mark.parametrize(
    "losses",
    [
        [10.83, 10.79, 10.86, 10.81, 10.84, 10.80, 10.85],  # seven near ln V, none on it: few
        [2.30 + 0.01 * (-1) ** i for i in range(12)],  # an LM's plateau at 2.30 +- 0.4%
        [10.92 - 0.025 * i for i in range(10)],  # a slow fall through the band: learning
        [10.5 + 0.01 * (-1) ** i for i in range(12)],  # flat, but at no chance level
        [1.39 + 0.004 * (-1) ** i for i in range(12)],  # an SFT plateau near ln 4 +- 0.3%
        [0.6931, 0.6925, 0.6938, 0.6921, 0.6940, 0.6918, 0.6935, 0.6915],  # DPO leaving ln 2
    ],
    ids=["seven", "lm-plateau", "falling", "no-level", "sft-plateau", "dpo-moving"],
)
def test_what_is_no_chance_level(losses: list[float]) -> None:
    assert _run(_records(losses)) == []


@pytest.mark.parametrize(
    ("losses", "outputs"),
    [
        ([0.6931] * 12, 2),  # a DPO / reward-model loss that never leaves ln 2
        ([1.0986] * 12, 3),  # three classes, a uniform guess
        ([1.3863, 1.3862, 1.3863, 1.3863, 1.3862, 1.3863, 1.3863, 1.3863], 4),  # QuALITY's eval
    ],
    ids=["pairwise", "three", "four"],
)
def test_a_few_outputs_guessed_uniformly_are_chance_level(
    losses: list[float], outputs: int
) -> None:
    [stall] = _run(_records(losses))[:1]
    assert stall.evidence["outputs"] == outputs


def test_a_dpo_loss_at_ln2_while_its_lr_warms_up_waits_unless_no_gradient_flows() -> None:
    """DPO starts at ln 2 (policy = reference) and may sit there while its LR warms up; with a
    gradient norm of exactly 0 nothing can move it (issue #39's first-sight log: 0.6931 flat
    beside 'grad_norm': 0.0)."""

    def dpo(norm: float) -> list[StepRecord]:
        return [
            StepRecord(i + 1, {"loss": 0.6931, "grad_norm": norm, "lr": 5e-7 * (i + 1)})
            for i in range(12)
        ]

    assert _run(dpo(1.3)) == []
    [stall] = _run(dpo(0.0))[:1]
    assert (stall.kind, stall.step, stall.evidence["outputs"]) == ("stall", 1, 2.0)
    assert "ln(2) = 0.69315" in stall.message and "pairwise preference" in stall.message


def test_four_records_on_a_uniform_guess_at_a_steady_lr_are_chance_level() -> None:
    """dpo_llms_tool_issue46: 'loss': 0.6931 on four records in a row while the LR decays from
    1e-05 (no warm-up): a DPO that learns leaves ln 2 within a step or two at that LR."""
    lrs = [9.99231529256779e-06, 9.991217477220333e-06, 9.990119661872873e-06, 9.989e-06]
    records = [StepRecord(i + 1, {"loss": 0.6931, "lr": lr}) for i, lr in enumerate(lrs)]
    [stall] = _run(records)
    assert (stall.step, stall.end_step, stall.evidence["outputs"]) == (1, 4, 2.0)
    # Three such records, or four with no LR logged (a warm-up cannot be ruled out): too few.
    assert _run(records[:3]) == []
    assert _run([StepRecord(r.step, {"loss": 0.6931}) for r in records]) == []


def test_a_smooth_plateau_across_ln_15_at_a_steady_lr_is_no_chance_level() -> None:
    """An LM's interval-averaged loss at a plateau of 2.70-2.71 moves 0.01-0.05% a record, near
    ln 15 = 2.7081 (the golden chaotic-0 stream had four such records): a uniform guess prints
    one number, a plateau moves in the fourth digit."""
    losses = [2.7085, 2.7080, 2.7078, 2.7083, 2.7079, 2.7084, 2.7077, 2.7082, 2.7080]
    records = [StepRecord(5000 + 10 * i, {"loss": v, "lr": 3e-4}) for i, v in enumerate(losses)]
    assert _run(records) == []


def test_a_short_log_past_the_start_on_a_uniform_guess_is_chance_level() -> None:
    """llm_shearing_issue24: one Composer record at batch 366, the cross-entropy 10.3750 =
    ln(32000) to 0.02% (perplexity 32048): the model predicts uniformly after 366 updates."""
    [stall] = _run([StepRecord(366, {"loss": 10.375})])
    assert (stall.step, stall.evidence["outputs"]) == (366, 32000.0)
    assert "the whole log" in stall.message
    assert _run([StepRecord(36, {"loss": 10.375})]) == []  # at its run's start: no evidence
    assert _run([StepRecord(366, {"loss": 10.31})]) == []  # 0.6% off: a plateau near it


def test_a_warm_up_plateau_near_chance_at_the_start_is_no_stall() -> None:
    """custom_llm_pretrain_ep_batch's shape, logged more often: a from-scratch LM sits near
    ln(vocab) while its LR warms up; at the start only a uniform guess (to 0.05%) is a stall."""
    plateau = [10.984375, 10.976562, 10.984375, 10.914062] * 3
    assert _run(_records(plateau, first=5, every=5)) == []
    [stall] = _run(_records([10.8259] * 8, first=5, every=5))
    assert stall.step == 5


def test_silent_at_chance_while_the_lr_is_zero() -> None:
    records = [StepRecord(100 + i, {"loss": 10.8259, "lr": 0.0}) for i in range(20)]
    assert _run(records) == []


def test_the_vocabulary_the_log_states() -> None:
    """ln(5000) = 8.517 is no common size; a log that states ``vocab_size`` 5000 makes it one."""
    losses = [8.52, 8.51, 8.53, 8.52, 8.50, 8.52, 8.53, 8.51]
    assert _run(_records(losses)) == []
    records = _records(losses)
    records[0] = StepRecord(records[0].step, {"loss": losses[0], "vocab_size": 5000.0})
    [stall] = _run(records)
    assert "uniform guess over 5000 tokens or classes (as the log states)" in stall.message


def test_a_chance_stretch_that_ends_says_where() -> None:
    losses = [2.3026] * 10 + [1.9, 1.7, 1.5]
    first, last = _run(_records(losses, first=0, every=100))
    assert (first.end_step, last.end_step) == (700, 900)
    assert "to the end" not in last.message


def test_chance_state_round_trip() -> None:
    first, second = Stall(), Stall()
    records = _records([4.6052] * 12)
    for record in records[:5]:
        first.update(record)
    second.load_state_dict(first.state_dict())
    assert [f.step for f in _run(records[5:], second)] == [1000, 1000]


def _with_norms(
    losses: list[float], norms: list[float], start: int = 10, every: int = 10
) -> list[StepRecord]:
    return [
        StepRecord(start + every * i, {"loss": loss, "grad_norm": norm, "lr": 1e-3})
        for i, (loss, norm) in enumerate(zip(losses, norms, strict=True))
    ]


# An OLMo run whose embeddings got no gradient (the round-6 held-out set's
# olmo_fork_20m_gradnorm_vanishes...): the norm vanishes to exactly 0, the loss stays about 9.6.
_VANISHING = [10.0, 9.737, 9.670, 9.847, 9.644, 9.646, 9.619, 9.587, 9.638, 9.602, 9.736, 9.640]
_NORMS = [1e-5, 5e-12, 7e-19] + [0.0] * 9


def test_a_zero_gradient_under_a_flat_loss_at_the_start_is_a_stall_at_once() -> None:
    """No gradient, no learning: 8 records in a row at a gradient norm of exactly 0 and a loss
    that does not fall decide the start rule there, not at step 300."""
    found = Engine([Stall()]).replay(_with_norms(_VANISHING, _NORMS))
    [stall] = [f for f in found if f.severity >= Severity.WARNING]
    assert (stall.kind, stall.step, stall.end_step) == ("stall", 10, 110)
    assert "gradient norm of exactly 0 on the last 8 records" in stall.message
    assert stall.evidence["zero_grad_records"] == 8.0


def test_a_zero_gradient_norm_beside_a_falling_loss_is_no_stall() -> None:
    """The HF Trainer under DeepSpeed ZeRO-3 logs a gradient norm of 0.0 while the run learns:
    a loss that falls over the stretch is learning, whatever the norm printed."""
    losses = [2.10 - 0.012 * i + 0.004 * (-1) ** i for i in range(30)]
    assert Engine([Stall()]).replay(_with_norms(losses, [0.0] * 30)) == []


def test_a_zero_gradient_norm_mid_run_is_the_trainer_not_computing_it() -> None:
    """Megatron-DeepSpeed prints ``grad norm: 0.000`` at every iteration (BigScience tr1-13B at
    iteration 29020, lm loss 2.77): a stream from mid-run is not judged by the start rule."""
    losses = [2.776, 2.773, 2.768, 2.771, 2.770, 2.772, 2.769, 2.771, 2.770, 2.768, 2.770] * 2
    records = _with_norms(losses, [0.0] * len(losses), start=29020)
    assert Engine([Stall()]).replay(records) == []


def test_a_zero_gradient_norm_while_the_lr_is_zero_is_no_evidence() -> None:
    """At an LR of 0 (a warm-up's first steps) nothing moves anyway: the zero norm says
    nothing more, and the start rule waits."""
    records = [StepRecord(r.step, {**r.values, "lr": 0.0}) for r in _with_norms(_VANISHING, _NORMS)]
    assert Engine([Stall()]).replay(records) == []


def _feed_at(detector: Stall, steps_losses: list[tuple[int, float]]) -> list[Finding]:
    found: list[Finding] = []
    for step, loss in steps_losses:
        found += detector.update(StepRecord(step, {"loss": loss, "lr": 1e-4}))
    return found + detector.finish()


def test_a_loss_frozen_to_its_last_digit_is_a_stall_mid_run() -> None:
    """74 rows of a Lightning CSV at 16.74222755432129 (a collapsed contrastive model): six
    records in a row at different steps decide, from mid-run (no start in view)."""
    noisy = [(1000 + 50 * i, 20.0 + (i % 3)) for i in range(6)]
    frozen = [(1300 + 50 * i, 16.74222755432129) for i in range(10)]
    [stall] = _feed_at(Stall(), noisy + frozen)
    assert (stall.kind, stall.step, stall.end_step) == ("stall", 1300, 1550)
    assert "the same to 6 significant digits" in stall.message
    # the last bits of an fp32 mean may differ: 0.35977894 and 0.35977891 are one value
    epochs = [(e, 0.35977894 if e < 21 else 0.35977891) for e in range(16, 22)]
    assert [f.kind for f in _feed_at(Stall(), epochs)] == ["stall"]


@pytest.mark.parametrize(
    "series",
    [
        [(s, 16.74222755432129) for s in range(5)],  # five records: not enough
        [(s, 11.875) for s in range(20)],  # bf16's coarse loss (5 digits) repeats by chance
        [(s, 1.8673) for s in range(20)],  # printed to 5 digits
        [(s, 0.0) for s in range(20)],  # a loss at zero
        [(7, 2.345678901)] * 20,  # one step printed again and again (ranks, a bar's redraws)
        [(s, 2.345678901 + 1e-5 * (s % 2)) for s in range(20)],  # it moves in the 6th digit
    ],
    ids=["five", "bf16", "five-digits", "zero", "one-step", "moves"],
)
def test_a_loss_that_repeats_by_chance_is_not_frozen(series: list[tuple[int, float]]) -> None:
    assert not _feed_at(Stall(steps=10**6), series)


def test_a_frozen_loss_with_the_lr_at_zero_is_not_judged() -> None:
    found: list[Finding] = []
    detector = Stall(steps=10**6)
    for step in range(20):
        found += detector.update(StepRecord(step, {"loss": 2.345678901, "lr": 0.0}))
    assert not found


def test_a_frozen_stretch_resumes_from_a_checkpoint() -> None:
    first, second = Stall(steps=10**6), Stall(steps=10**6)
    _feed_at(first, [(s, 3.141592653) for s in range(4)])
    second.load_state_dict(first.state_dict())
    assert [f.step for f in _feed_at(second, [(s, 3.141592653) for s in range(4, 8)])] == [0]


def _sparse(losses: list[float], every: int = 100) -> list[Finding]:
    stall = Stall()
    found: list[Finding] = []
    for index, loss in enumerate(losses):
        found += stall.update(StepRecord(index * every, {"loss": loss, "lr": 0.1}))
    return found + stall.finish()


def test_a_log_of_every_100th_step_is_judged_at_its_tenth_loss() -> None:
    """ST-GCN on Kinetics (mmskeleton#46): a loss every 100 batches, 5.96 at 100 and 5.83-5.93
    to 1600. At step 300 there were four losses, too few to judge, and the rule gave up for
    good: the flat loss was never called. It waits for its tenth loss (step 900)."""
    losses = [6.3596, 5.9635, 5.8815, 5.8872, 5.9088, 5.8656, 5.8867, 5.8330, 5.9027, 5.8755]
    losses += [5.8760, 5.8521, 5.8933, 5.9311, 5.8277, 5.8691, 5.8348]
    [stall] = _sparse(losses)
    assert (stall.kind, stall.step, stall.end_step) == ("stall", 0, 900)


def test_losses_too_few_and_too_noisy_to_rule_out_a_fall_are_not_yet_a_stall() -> None:
    """HisToGene's MSE every 50 steps (a Lightning CSV): 0.237, 0.238, 0.219, then ±0.05 of
    batch noise around a slow drift down. Ten such losses cannot rule out a 10% fall (the
    line through them may fall that far): no stall; the same ten, flat to 1%, are one."""
    rng = random.Random(1)
    noisy = [0.23 - 0.0008 * k + rng.uniform(-0.05, 0.05) for k in range(10)]
    assert _sparse(noisy, every=50) == []
    flat = [0.23 + rng.uniform(-0.002, 0.002) for _ in range(10)]
    assert [f.kind for f in _sparse(flat, every=50)] == ["stall"]
    # As noisy but flat for longer: looked at again with twice the losses (20, 40, 80), not at
    # every loss (noise would tip one look at last), it is surely flat at one of those looks.
    flat = [0.23 + rng.uniform(-0.05, 0.05) for _ in range(100)]
    [stall] = _sparse(flat, every=50)
    assert stall.kind == "stall" and stall.end_step in (19 * 50, 39 * 50, 79 * 50)
