"""`Diverged`: a stream that begins already broken, by bounds no healthy run comes near."""

from __future__ import annotations

import math

import pytest

from stabilizer.core.detectors import Diverged
from stabilizer.core.detectors.diverged import (
    GRAD_ALONE,
    GRAD_WITH_LOSS,
    LOSS_WITH_GRAD,
    OUT_OF_PROPORTION,
)
from stabilizer.core.records import Finding, Severity, StepRecord

# openpi#814 (tests/fixtures/real/logs/openpi_issue814_loss_1e8_gradnorm_1e6.log), first lines
OPENPI = [(681325.8, 344671968.0), (846482.4, 436317056.0), (549847.9, 247026608.0)]
OPENPI += [(775058.4, 536607616.0), (897108.3, 267218320.0)]


# benchmarks/regimes' huge-scale (a regression on prices in dollars, healthy), seed 0's first
# 5 steps as the live monitor recorded them (its JSONL): the gradient scales with the targets
DOLLARS = [(4.84e8, 3.51e8), (5.31e8, 3.8e8), (5.28e8, 3.59e8), (4.88e8, 3.54e8), (5.36e8, 4.07e8)]


def _run(
    pairs: list[tuple[float, float | None]], first: int = 5900, every: int = 100
) -> list[Finding]:
    detector, found = Diverged(), []
    for i, (grad, loss) in enumerate(pairs):
        values = {"grad_norm": grad} if loss is None else {"grad_norm": grad, "loss": loss}
        found += detector.update(StepRecord(first + every * i, values))
    return found + detector.finish()


def test_a_log_that_begins_broken() -> None:
    first, last = _run(OPENPI)
    assert (first.kind, first.step, first.end_step, first.severity) == (
        "diverged",
        5900,
        6100,
        Severity.ERROR,
    )
    assert (last.step, last.end_step, last.evidence["records"]) == (5900, 6300, 5.0)
    assert "gradient norm up to 8.97e+05 beside a loss of up to 5.37e+08" in last.message
    assert "to the end of the log" in last.message


def test_a_gradient_norm_no_run_survives_needs_no_loss() -> None:
    """grokfast#9's shape: 3.8e12 and growing from the first record, the loss 11."""
    [found] = _run([(3.8e12, 11.1), (1.2e13, 11.3), (4.4e13, 11.7)], first=1)
    assert found.step == 1 and "beside" not in found.message


@pytest.mark.parametrize(
    "pairs",
    [
        [(3e5, 4e6), (5e5, 2e6), (4e5, 3e6), (6e5, 5e6)],  # a regression: loss 1e6, healthy
        [(1.3e4, 3.06), (2.6e5, 3.11), (2.5e5, 7.71)],  # BigScience 104B's spike: relative
        [(5e5, 3e8), (6e5, 4e8)],  # two records: too few
        [(0.9, 2.5), (7e5, 4e8), (8e5, 5e8), (9e5, 4e8)],  # a healthy record first: a change
        [(math.nan, 3e8), (7e5, 4e8), (8e5, 5e8), (9e5, 4e8)],  # NaN first: NonFinite's
        [(7e5, None), (8e5, None), (9e5, None)],  # no loss beside 2e5-1e8
    ],
    ids=["regression", "spike", "two", "healthy-first", "nan-first", "no-loss"],
)
def test_silent(pairs: list[tuple[float, float | None]]) -> None:
    assert _run(pairs) == []


@pytest.mark.parametrize(("first", "every"), [(0, 1), (1, 1), (100, 100), (10, 10)])
def test_a_log_from_its_runs_start_is_the_runs_own_scale(first: int, every: int) -> None:
    """Gradient norms of 1e8 and losses of 1e8 from the first step on: a regression on
    unnormalised targets (the harm benchmark's huge-scale, a live run from step 0), or
    openpi#814's levels had its log begun at its run's start: no earlier level to diverge from."""
    assert _run(DOLLARS, first, every) == []
    assert _run(OPENPI, first, every) == []


def test_a_gradient_out_of_all_proportion_is_broken_from_the_start() -> None:
    """grokfast#9's 3.8e12 beside a loss of 11, from step 1: no loss's scale explains it."""
    [found] = _run([(3.8e12, 11.1), (1.2e13, 11.3), (4.4e13, 11.7)], first=1, every=1)
    assert found.step == 1
    assert _run([(3.8e12, 3.8e7), (1.2e13, 1.2e8), (4.4e13, 4.4e8)], first=1, every=1) == []


def test_an_excerpt_of_a_dollar_regression_is_judged_by_its_levels() -> None:
    """A limit, kept on purpose: an excerpt from step 5900 at openpi#814's levels is read as
    openpi#814 (the log does not say what its loss measures)."""
    assert [f.kind for f in _run(DOLLARS)] == ["diverged", "diverged"]


def test_an_excerpt_out_of_all_proportion_on_each_of_its_two_records() -> None:
    """mmdetection#3446: DetectoRS from its first logged iteration, grad_norm 3.8e12 beside a
    loss of 59,308, then 4.1e10 beside 21,082, and the excerpt ends: broken as a whole."""
    [found] = _run([(3801898445783.2651, 59307.8674), (40558643632.8485, 21082.308)], 50, 50)
    assert (found.kind, found.step, found.end_step) == ("diverged", 50, 100)
    assert found.evidence["records"] == 2.0
    assert _run([(3.8e12, 5.9e4)], 50, 50) == []  # one record alone: maybe one outlier


def test_a_stretch_that_ends_says_so() -> None:
    found = _run([*OPENPI[:4], (2.0, 1.5), (7e5, 4e8), (8e5, 5e8), (9e5, 4e8)])
    assert [(f.step, f.end_step) for f in found] == [(5900, 6100), (5900, 6200)]
    assert "in range again after step 6200" in found[1].message


def test_the_bounds_stay_far_from_healthy_runs() -> None:
    assert GRAD_WITH_LOSS >= 10 * 1.3e4  # an order above the largest healthy gradient norm known
    assert LOSS_WITH_GRAD >= 10 * 1e6  # ten times a healthy regression's loss
    assert GRAD_ALONE >= 1e4 * 1.3e4 / 2
    assert OUT_OF_PROPORTION >= 100 * 7e3 / 5  # a detection model's start, 100 times over


def test_records_must_be_positive() -> None:
    with pytest.raises(ValueError, match="`records` must be >= 1, got 0"):
        Diverged(records=0)


def _perplexities(ppls: list[float], vocab: float | None = None, first: int = 200) -> list[Finding]:
    detector, found = Diverged(), []
    for i, ppl in enumerate(ppls):
        values = {"loss": math.log(ppl), "ppl": ppl}
        if vocab is not None:
            values["vocab_size"] = vocab
        found += detector.update(StepRecord(first + 200 * i, values))
    return found + detector.finish()


def test_a_perplexity_worse_than_any_uniform_guess_is_broken_from_the_start() -> None:
    """PyTorch's word_language_model at LR 20 (nlpia2's log: ``loss 17.74 | ppl 50880577``,
    ...) and OpenNMT's perplexity at its exp(100) cap from its first line: a per-token
    cross-entropy 1.25x ln V above every vocabulary's chance level, from the first record on.
    Silent on a language model at its start (ppl about V, up to 5% above ln V) and on one that
    learns from there; a stated vocabulary sets the bar."""
    word_lm = [50880577.49, 85943523.12, 67171329.34, 73022626.80, 101587935.59]
    first, found = _perplexities(word_lm)  # when the records are in; at the log's end
    assert (first.kind, first.step, first.end_step) == ("diverged", 200, 600)
    assert (found.kind, found.step, found.end_step) == ("diverged", 200, 1000)
    assert found.evidence["ppl"] == max(word_lm) and "grad_norm" not in found.evidence
    assert "above V^1.25 for V = 256000 tokens (the largest vocabulary we know)" in found.message
    assert _perplexities([math.inf] * 5) == []  # (a non-finite loss is NonFinite's)
    assert _perplexities([math.exp(100)] * 5, vocab=22441)[-1].evidence["records"] == 5.0
    start = [256000 * 1.7, 256000 * 1.2, 30000.0, 9000.0, 2000.0]  # ln V + 5%, then learning
    assert _perplexities(start) == []
    assert _perplexities([50257.0**1.3] * 5) == []  # beyond GPT-2's, not Gemma's chance level
    assert _perplexities([50257.0**1.3] * 5, vocab=50257)[0].kind == "diverged"


def test_a_perplexity_that_climbs_past_any_uniform_guess_mid_log_diverged() -> None:
    """The same word_language_model at LR 20, its epoch 4 (nlpia2): ppl 2e5-7e5, then 1.2e6,
    8.7e6, 3.0e7 and staying there. The first records were in range, so the log began healthy
    (by this rule) and it was never judged again: the climb past V^1.25 was missed. Two records
    beyond chance and back (a spike: LossSpike's) are no divergence; a log that never prints a
    perplexity stops being judged after its first records."""
    epoch4 = [716072.9, 452369.37, 433134.17, 620734.88, 280058.72, 232633.12, 242113.13]
    epoch4 += [201190.67, 1150767.31, 8664387.72, 29673629.81, 33959082.26, 33533519.32]
    first, last = _perplexities(epoch4)
    assert (first.kind, first.step, first.end_step) == ("diverged", 2000, 2400)
    assert (last.step, last.end_step) == (2000, 2600)
    assert (
        "the run diverged at step 2000" in last.message and "first of the log" not in last.message
    )
    assert _perplexities([*epoch4[:8], 3e7, 3e7, 2e5, 2e5]) == []
    detector = Diverged()
    detector.update(StepRecord(1, {"loss": 2.0, "grad_norm": 1.0}))
    assert detector.done
