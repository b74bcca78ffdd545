"""`stabilizer diagnose` on real logs nobody here wrote: each gets its label right.

The logs and their labels are in ``tests/fixtures/real`` (sources in its README). A case is right
by the rule of the labelled set's scorer (``shared/reallogs/score.py``, restated in `right`): a
healthy log gets no finding at warning or above; a troubled one gets a finding of an accepted kind
whose step range overlaps the labelled steps, widened by two logging intervals.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from stabilizer.cli import main

REAL = Path(__file__).parent / "fixtures" / "real"
CASES = [json.loads(line) for line in (REAL / "labels.jsonl").read_text().splitlines() if line]

# The kinds that count for each label (a substring of the finding's kind), as score.py has them.
ACCEPT = {
    "nan": ("nonfinite", "nan", "overflow"),
    "spike": ("spike",),
    "divergence": ("diverg", "loss_spike", "stall"),
    "overflow": ("overflow",),
    "grad_explosion": ("grad", "diverg"),
    "stall": ("stall",),
}


def right(case: dict[str, Any], report: dict[str, Any]) -> bool:
    """Whether the ``--json`` report gets the case's label right (score.py's rule)."""
    findings = [f for f in report["findings"] if f["severity"] not in ("info", "debug")]
    if case["label"] == "healthy":
        return not findings
    source = report["inputs"][0]
    steps, records = source.get("steps") or {}, source.get("records") or 0
    interval = (steps["last"] - steps["first"]) / (records - 1) if records > 1 else 0.0
    window = case.get("steps")

    def matches(finding: dict[str, Any]) -> bool:
        if not any(kind in finding["kind"].lower() for kind in ACCEPT[case["label"]]):
            return False
        if not window:
            return True
        start = finding["step"]
        end = finding["end_step"] if finding.get("end_step") is not None else start
        return bool(start <= window[1] + 2 * interval and end >= window[0] - 2 * interval)

    return any(matches(f) for f in findings)


# Known misses, each for a reason the log's own numbers cannot settle yet (strict: a fix shows).
MISSES = {
    "opennmt_legacy_issue709_unstable": "the loss swings at chance level (ln vocab ~10.4) 13k "
    "steps in: without the vocabulary size a person reading the excerpt sees xent fall from 10.5 "
    "to 7.7 and rise to 9.95 (1.29x), the swing of a noisy early run; only ln(vocab) makes it "
    "chance level",
    "deepspeed_fused_optimizer_issue697_low_scale": "one overflow at scale 8 -> 4 between timer "
    "lines: a person sees one skipped step, which a scaler probing at 4-16 (fairseq's summed "
    "losses live there) prints as well; only a scale at or below 1 says collapse from one skip",
    "marian_issue376_bouncy_spike": "Cost 5.20 -> 6.60 (1.27x) with one record before it (one "
    "every 2000 updates): no baseline to call it a spike, and it recovers",
    # issue #39: the round-5 logs' first-sight misses (docs/benchmarks.md, "First sight, round 5")
    # that the readers do not read right yet (#39's reading half read the others: words, bare
    # rows, values before names, the HF Trainer's window of NaN logged as 0; its judging half
    # judged the chance levels of llm_shearing#24 and dpo_llms_tool#46)
    "gpt_neox_issue947_llama_bf16_loss_jumps_to_11": "first sight, round 5: lm_loss 2.28 -> "
    "11.05 (above ln 32000) after the first update is missed: two records, no baseline, and no "
    "chance level to compare the jump with",
    "bigscience_tr8_104B_exp1_jump_not_back": "first sight, round 5: lm loss 6.44 -> 11.42 "
    "(grad norm 98k -> 220k) and 7.16 210 iterations later, with a '[...]' gap and a validation "
    "line between: three records, no baseline, the jump not judged by what followed",
    "odtk_retinanet_issue146_loss_diverging_words": "first sight, round 5: the trainer's words "
    "'RuntimeError: Loss is diverging!' were ignored; read now (words.WORDS) as what ODTK's "
    "source raises them for, a non-finite loss (odtk/train.py: `not isfinite(cls_loss + "
    "box_loss)`): nonfinite_loss and trainer_said, which the label 'divergence' does not take",
    # The held-out set's first-sight misses on the round's final code (docs/benchmarks.md, "First
    # sight on a held-out set"): merged after scoring, nothing tuned on them; the next round's work.
    "qwen_issue117_full_sft_loss_1e11": "held out, round 5: a token loss of 2.5e11 from the first "
    "record is broken on its face (ln V ~ 12 at worst); the excerpt that begins broken is judged "
    "only by its changes",
    "llamafactory_issue251_baichuan_overflow_cascade_lr0": "held out, round 5: no finding; "
    "DeepSpeed's OVERFLOW lines run onto tqdm fragments, the scale halving 128 -> 8 a step",
    "pointer_summarizer_issue39_nan_at_8400": "held out, round 5: the NaN is found at "
    "step 3, not 8400: the '>steps N, ...' quote's step is not the one read",
    # Round 6's held-out set: its first-sight misses (docs/benchmarks.md, "First sight on a
    # held-out set (round 6)"), scored on 28a2b4d before anything was changed for them.
    "transformers_issue18132_apex_f1_and_loss_frozen_stall": "held out, round 6: a loss frozen to "
    "the printed digit over three epochs, at no chance level, is no rule",
    "dmrgcn_issue1_train_loss_frozen_val_nan_stall": "held out, round 6: its training loss is "
    "frozen to the printed digit (46.05170378351126) on 5 epoch records only, one fewer than the "
    "frozen-loss rule takes (the bar's 0.35977894 is a series of its own now)",
    "uoais_issue16_adet_loss_nan_at_iteration0_words": "held out, round 6: NaN said only in the "
    "trainer's words (detectron2's FloatingPointError at iteration 0, no loss_dict after it) is "
    "not heard: a catalogue row for it made the words a record of their own, which took the step "
    "from the loss_dict line that follows it elsewhere (detectron2#838)",
    # Round 7's held-out set: its first-sight misses (docs/benchmarks.md, "First sight on a
    # held-out set (round 7)"), scored on dde525e before anything was changed for them.
    "trace_issue5_llama3_lora_identical_epoch_losses_stall": "held out, round 5: read now (as "
    "generic, after the HF reader its head chose found no step), but an epoch that repeats the "
    "last one's losses digit for digit, step for step, is no rule yet",
    # Round 8's held-out set: its first-sight misses (docs/benchmarks.md, "First sight on a
    # held-out set (round 8)"), scored on b106763 before anything was changed for them; what the
    # round's general changes did not fix.
    "relernn_issue26_keras_epoch309_loss_nan": "held out, round 8: the label counts epochs "
    "(309), the reader the batches across epochs (30899 = epoch 309's 99th of 100): both are the "
    "log's numbers, the finding's is not the label's",
    "deepj_issue49_keras_epoch65_loss_doubles_not_back": "held out, round 8: as relernn: a loss "
    "spike found at 722964 (epoch 66's last batch of 10954), the label counts epochs (65-66)",
    "deep_avsr_issue43_vo_pretrain_loss_rises_to_flat_cer_1": "held out, round 8: a loss that "
    "rises over 5 records and sits flat with CER 1.0 is no rule (a stall, or a divergence)",
    # Round 8's second held-out set: its first-sight misses, scored on f4de524 (docs/benchmarks.md,
    # "A second held-out set (round 8, at the round's end)").
    "litgpt_issue2151_ptl_trainer_lr_zero_weights_frozen_stall": "held out, round 8 (second "
    "set): an LR printed 0.0 and weights' statistics the same to six digits over six steps: a "
    "stall by its LR, too short for the frozen-loss rule",
    # Round 9's held-out set: its first-sight misses (docs/benchmarks.md, "First sight on a
    # held-out set (round 9)"), scored on c234304 before anything was changed for them.
    "paddlespeech_issue675_lr_zero_flat_ctc_loss_stall": "held out, round 9: an LR printed "
    "0.00000000 on every line, the CTC loss noisy about 16: a stall by its LR, which a record "
    "does not tell from a warm-up's 0.000000 or a rounded 0.000 (the printed digits are lost)",
    "litgpt_issue834_lora_ddp_per_batch_losses_repeat_exactly_stall": "held out, round 9: nine "
    "exact losses that recur over 22 micro-batches (3.5073 five times): the same batches give the "
    "same loss, the weights do not change; no rule reads recurring values (the frozen-loss rule "
    "wants them in a row), and a record does not keep the digits printed (an fp16 grid repeats)",
    "video_caffe_issue11_c3d_test_loss_to_87_flt_min_clamp_divergence": "held out, round 9: only "
    "the test net's loss is printed (3.31, then Caffe's 87.3366 = -ln FLT_MIN); a held-out series "
    "is shown, never judged as the training loss, and there is none",
    # Round 9's second held-out set: its first-sight misses (docs/benchmarks.md, "A second
    # held-out set (round 9, at the round's end)"), scored on 6a4427d before any change for them.
    "gui_actor_qwen25vl_stage2_gradnorm_1e7_loss_rising_grad_explosion": "held out, round 9 "
    "(second set): gradient norms of 2e6-4e7 on all seven records from the first, the loss "
    "2.56 -> 3.32: no earlier norm to spike from, and under Diverged's bounds (1e8 alone, or "
    "2e5 beside a loss of 1e7)",
    "lyric_gpt_trainer_state_per_step_loss_climbs_6_to_25_above_ln_vocab_divergence": "held out, "
    "round 9 (second set): read now (its pasted log_history objects), but a per-step loss "
    "noisy by +-30% that drifts 9 -> 23 over 60 records: its first records' spread puts a "
    "spike's bar at 32, the baseline follows the drift, no rule reads a steady climb, and a "
    "loss alone is never judged by its level",
}


def _case(case: dict[str, Any]) -> Any:
    miss = MISSES.get(case["id"])
    marks = [pytest.mark.xfail(reason=miss, strict=True)] if miss else []
    return pytest.param(case, id=case["id"], marks=marks)


@pytest.mark.parametrize("case", [_case(c) for c in CASES])
def test_real_log_gets_its_label(case: dict[str, Any]) -> None:
    path = REAL / "logs" / f"{case['id']}.log"
    result = CliRunner().invoke(main, ["diagnose", "--json", str(path)])
    assert result.exit_code in (0, 1), result.output  # 2: refused or unreadable
    report = json.loads(result.stdout)
    got = [(f["kind"], f["severity"], f["step"], f.get("end_step")) for f in report["findings"]]
    assert right(case, report), f"{case['label']} {case.get('steps')}: got {got}"


def test_the_rule_can_fail() -> None:
    """A troubled case with no finding, or a finding elsewhere, is wrong; a false alarm too."""
    case = {"label": "spike", "steps": [100, 100]}
    source = {"steps": {"first": 0, "last": 1000}, "records": 101}  # every 10 steps
    spike = {"kind": "loss_spike", "severity": "warning", "step": 500, "end_step": 510}
    assert not right(case, {"findings": [], "inputs": [source]})
    assert not right(case, {"findings": [spike], "inputs": [source]})
    assert right(case, {"findings": [{**spike, "step": 115}], "inputs": [source]})
    assert not right({"label": "healthy"}, {"findings": [spike], "inputs": [source]})
