"""The universal reader on real logs: what a person reads in each of `tests/fixtures/real/`.

Every expectation below was read off the log's text by eye (see each log and its label's
justification), not taken from the reader's output: how many steps the excerpt shows, the first
and last of them, which signals are printed, and where the first NaN is. Where the log has its
own reader (Megatron/BigScience, DeepSpeed, fairseq, the HF Trainer), the same facts hold for it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from stabilizer.core.records import StepRecord
from stabilizer.replay.readers import CsvTableReader, detect_format
from stabilizer.replay.readers.universal import UniversalReader

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "real"
LOSS, GNORM, LR, SCALE, SKIP, VAL = "loss", "grad_norm", "lr", "loss_scale", "skipped", "val_loss"


@dataclass(frozen=True)
class Seen:
    """What a person reads in a log.

    Args:
        records: Steps (records) the excerpt shows.
        first: The first step, as printed (or where a line without one belongs).
        last: The last step.
        keys: Signals printed at (some) steps.
        nan: The step and signal of the first NaN/Inf, if any.
    """

    records: int
    first: int
    last: int
    keys: frozenset[str]
    nan: tuple[int, str] | None = None


def seen(
    records: int, span: tuple[int, int], *keys: str, nan: tuple[int, str] | None = None
) -> Seen:
    return Seen(records, span[0], span[1], frozenset(keys), nan)


SEEN = {
    # lead's development set
    "bigscience_tr11_176B_throughput_drop": seen(5, (42780, 42784), LOSS, GNORM, LR),
    "bigscience_tr8_104B_exp11_spike": seen(3, (11446, 11448), LOSS, GNORM, LR, SCALE),
    # issue #32 class 7 (DIAG-B): BigScience chronicles, per-iteration and 10-iteration averages
    "bigscience_tr8b_104B_resume_divergence": seen(9, (17060, 17068), LOSS, GNORM, LR, SCALE),
    "bigscience_tr8_104B_glitch_ramp": seen(5, (6900, 6940), LOSS, GNORM, LR, SCALE),
    "bigscience_tr1_13B_loss_jump": seen(8, (29020, 29090), LOSS, GNORM, LR, SCALE),
    "bigscience_tr11_176B_first_spike": seen(11, (31214, 31251), LOSS, GNORM, LR),
    # issue #32 class 5 (DIAG-B): 3,001 records of llm.c, validation every 250 steps
    "llmc_gpt2_124m_norm_bumps_long": seen(3001, (7000, 10000), LOSS, GNORM, LR, VAL),
    "custom_llm_pretrain_ep_batch": seen(13, (20, 260), LOSS),
    # one overflow (three ranks, three lines each), scale 8 -> 4, "Grad overflow on iteration 3"
    "deepspeed_fused_optimizer_issue697_low_scale": seen(1, (3, 3), SKIP, SCALE),
    "deepspeed_issue931_startup_probing": seen(4, (1, 4), SKIP, SCALE),
    "detectron2_issue838_nan_iter2137": seen(1, (2137, 2137), LOSS, nan=(2137, LOSS)),
    # seven warnings just before the summary of batches 12009-12640
    "espnet2_issue3170_gradnorm_nan": seen(8, (12633, 12640), LOSS, GNORM, nan=(12633, GNORM)),
    # the first overflow comes before update 190
    "fairseq_issue515_lightconv_scale_collapse": seen(9, (189, 486), LOSS, GNORM, LR, SCALE, SKIP),
    "hf_trainer_crystal_issue6_gradnorm_blowup": seen(8, (1, 8), LOSS, GNORM, LR),
    # Keras: 100 batches an epoch, epochs 1-3
    "keras_maskrcnn_issue1997_nan": seen(3, (100, 300), LOSS, VAL, nan=(100, LOSS)),
    "keras_per_batch_moire_healthy": seen(14, (1, 14), LOSS),
    "lightning_progressbar_issue4225_healthy": seen(5, (1, 5), LOSS),
    "llamafactory_issue3529_pretrain_healthy": seen(6, (1, 6), LOSS, GNORM, LR),
    "llmc_gpt2_124m_speedrun_start": seen(249, (0, 248), LOSS, GNORM, LR, VAL),
    "modded_nanogpt_1b_single_step_spike": seen(160, (5892, 6051), LOSS, VAL),
    "nanogpt_issue178_shakespeare_healthy": seen(26, (0, 250), LOSS, VAL),
    "opennmt_legacy_issue709_unstable": seen(11, (12900, 13400), LOSS),
    "opennmt_v1_issue1362_healthy": seen(9, (2250, 2650), LOSS, LR),
    "tf1_epos_step_total_loss_nan": seen(12, (0, 1100), LOSS, nan=(100, LOSS)),
    "torchtune_early_full_finetune_healthy": seen(18, (0, 17), LOSS, LR),
    # found for issue #12
    "nanogpt_issue215_fp16_nan_iter3010": seen(15, (2920, 3060), LOSS, VAL, nan=(3010, LOSS)),
    "litgpt_issue185_fsdp_nan_step1": seen(21, (0, 1), LOSS, nan=(1, LOSS)),  # a line per iter
    "litgpt_issue628_codellama_loss_jump": seen(9, (144, 145), LOSS),
    "mlx_examples_issue620_lora_loss_jump": seen(9, (1, 200), LOSS, LR, VAL),
    "mlx_examples_issue557_mixtral_lora_healthy": seen(12, (1, 110), LOSS, LR, VAL),
    "mmdet_issue11893_mmengine_nan": seen(1, (500, 500), LOSS, LR, nan=(500, LOSS)),
    "xtuner_issue187_gradnorm_nan": seen(6, (200, 250), LOSS, GNORM, LR, nan=(240, GNORM)),
    "xtuner_issue658_iter_gradnorm_nan": seen(8, (510, 580), LOSS, GNORM, LR, nan=(510, GNORM)),
    "detectron2_issue214_start_healthy": seen(7, (19, 139), LOSS, LR),
    # twelve overflows after update 10198
    "fairseq_issue512_overflow_cascade": seen(13, (10198, 10210), LOSS, LR, SCALE, SKIP, VAL),
    "ofa_issue108_overflow_from_start": seen(7, (1, 7), SKIP, SCALE),
    # the bar counts samples: 9595 an epoch, epochs 1-7
    "keras_sentence_cnn_issue7_nan_epoch2": seen(7, (9595, 67165), LOSS, VAL, nan=(19190, LOSS)),
    "mpii_face_gaze_issue3_nan_step100": seen(10, (0, 900), LOSS, nan=(100, LOSS)),
    "styletts2_issue167_multi_loss_healthy": seen(4, (110, 140), LOSS),
    # epochs 147-149 of 351 iterations, counted from epoch 1
    "mmpretrain_issue1632_mae_healthy": seen(6, (146 * 351 + 300, 148 * 351 + 200), LOSS, LR),
    "modded_llama2_pr9_lr_decay_healthy": seen(26, (420, 670), LOSS, LR, VAL),
    # found in the hunt for other trainers and shapes
    "torchtitan_pr3393_rank_prefix_healthy": seen(8, (14, 21), LOSS, GNORM),
    "nanotron_issue390_pipe_fields_healthy": seen(4, (327281, 327284), LOSS, GNORM, LR),
    # one interval, all 10 iterations skipped: no loss printed
    "megatron_bert_nccl743_startup_skips": seen(1, (10, 10), SCALE, LR),
    "megatron_lm_issue5_2019_no_colon_healthy": seen(4, (100, 400), LOSS, LR),  # "lm loss 1.0E+01"
    "megatron_ds_issue396_gradnorm_nan_no_loss": seen(
        3, (5426, 5428), GNORM, LR, SCALE, nan=(5426, GNORM)
    ),
    # iteration 5 printed over four lines; iteration 6's line shows only a timer
    "megatron_bridge_issue5306_wrapped_gradnorm_nan": seen(
        1, (5, 5), GNORM, LR, SCALE, nan=(5, GNORM)
    ),
    # the bar counts the run (41 steps an epoch), not the epoch
    "kohya_sdscripts_issue2137_avr_loss_nan": seen(5, (41, 205), LOSS, nan=(41, LOSS)),
    "truncated_diffusion_issue3_nan_step5": seen(9, (1, 9), LOSS, nan=(5, LOSS)),
    "diffusion_pipe_issue531_ltx2_nan_step18": seen(8, (16, 23), LOSS, nan=(18, LOSS)),
    # overflow lines glued to the bar: at its count (the first, before any bar: just before it)
    "hf_deepspeed_issue14531_scale_stuck_at_1": seen(4, (97, 100), SKIP, SCALE),
    "hf_deepspeed_t5_issue9996_startup_probing": seen(3, (6, 8), SKIP, SCALE),
    # 5 overflows glued to the bar's count they were printed at (378/2724 ...), and a dict
    "chinese_llama_issue534_scale_to_min": seen(6, (378, 382), SKIP, SCALE, LOSS, LR),
    "deepspeed_learn_issue1_wrapped_hysteresis_healthy": seen(6, (1, 6), SKIP, SCALE),
    "verse_issue31_loss_scale_collapse_nan": seen(
        3, (0, 200), LOSS, GNORM, SCALE, nan=(100, GNORM)
    ),
    "gradnorm_tf_issue17_epoch_loss_nan": seen(17, (3442, 3458), LOSS, nan=(3451, LOSS)),
    # epochs 8-10 of 266 batches; the mean of epoch 8 goes just before epoch 9's bar
    "radar_detector_issue3_mean_loss_nan": seen(
        5, (7 * 266 + 266, 9 * 266 + 266), LOSS, nan=(2393, LOSS)
    ),
    "mmdet_issue5911_markdown_bold_nan": seen(4, (50, 200), LOSS, LR, nan=(150, LOSS)),
    "bigdl_issue1486_loss_infinity": seen(3, (45457, 45459), LOSS, LR, nan=(45459, LOSS)),
    # Keras: 61878 samples an epoch, epochs 0-14
    "keras_issue21_epoch10_divergence": seen(15, (61878, 15 * 61878), LOSS),
    "mmdet_issue11708_gradnorm_31M": seen(2, (788 + 50, 788 + 100), LOSS, GNORM, LR),  # epoch 2
    "yolov5_issue4963_table_nan": seen(1, (1, 1), LOSS, nan=(1, LOSS)),  # epoch 1: box, obj, cls
    # epochs 22-23 of 954 batches; the loss is box + cls + dfl
    "ultralytics_issue21765_yolo_table_healthy": seen(2, (22, 23), LOSS),  # epochs 22, 23 of 55
    "rnnt_issue26_global_step_healthy": seen(12, (7, 18), LOSS),
    "sedd_issue9_training_loss_healthy": seen(11, (0, 500), LOSS, VAL),
    "dle_bert_squad_issue1107_step_loss_healthy": seen(9, (2872, 3272), LOSS, LR),
    "fcos_issue6_maskrcnn_benchmark_healthy": seen(5, (60, 140), LOSS, LR),
    # "[29/300][2670/2859]": epoch 29 (counted from 1), batch 2670 of 2859
    "vmamba_issue273_swin_logger_healthy": seen(
        4, (28 * 2859 + 2670, 28 * 2859 + 2700), LOSS, GNORM, LR, SCALE
    ),
    "ego_av_loc_issue3_noisy_healthy": seen(12, (36 * 588 + 20, 36 * 588 + 240), LOSS),
    "hifigan_pitchvc_issue3_steps_healthy": seen(15, (210005, 210075), LOSS),  # "Steps : 210005"
    # second hunt: other trainers and shapes
    # Marian: "Up. N" the update, "Cost" the loss; the [valid] lines join update 20000
    "marian_issue376_bouncy_spike": seen(7, (14000, 26000), LOSS),
    "marian_issue120_noisy_healthy": seen(8, (306350, 306420), LOSS),
    "ppasr_issue3_batch_nan": seen(9, (750, 830), LOSS, LR, nan=(790, LOSS)),
    "tfslim_hashtag_issue6_global_step_nan": seen(10, (2454, 2463), LOSS, nan=(2458, LOSS)),
    "allennlp_issue379_batch_healthy": seen(4, (1, 1701), LOSS),
    "multiffn_nli_issue2_batches_nan": seen(4, (100, 400), LOSS, VAL, nan=(100, LOSS)),
    "lion_issue9_loguru_bracket_nan": seen(5, (1574, 1634), LOSS, nan=(1574, LOSS)),  # "[step]"
    # epoch 127 (counted from 1) of 464 batches
    "rtm3d_issue4_avgmeter_healthy": seen(7, (126 * 464 + 35, 126 * 464 + 335), LOSS),
    "spacy_issue7083_v3_table_healthy": seen(6, (0, 1000), LOSS),  # "#" the step
    "trl_issue1236_dpo_loss_zero_healthy": seen(3, (1, 3), LOSS, LR),
    "d3feat_issue23_table_nan": seen(1, (9753, 9753), LOSS, nan=(9753, LOSS)),
    "mobilefacenet_issue40_total_step_healthy": seen(9, (24050, 24450), LOSS),
    "mobilenet_ssd_keras_issue21_terminate_on_inf": seen(1, (4, 4), LOSS, nan=(4, LOSS)),
    # epoch 1 of 11134 iterations, counted from 1
    "semseg_3d2d_issue4_noisy_healthy": seen(5, (750, 790), LOSS),
    "pytorch_tutorial_zh_issue1_test_loss_healthy": seen(15, (100, 1500), LOSS),  # 训练次数: N
    # third hunt: trainers and shapes not yet covered
    "paddleslim_issue1582_bracket_loss_nan": seen(6, (0, 50), LOSS, nan=(10, LOSS)),  # "[nan]"
    # "[Losses: x nan, ..., total nan]": the total of the losses is the loss
    "pytorch_yolov3_issue13_losses_total_nan": seen(4, (323, 326), LOSS, nan=(323, LOSS)),
    # four batch lines, no batch number: positions 1-4 ("epoch 0" is no step of its own)
    "bmn_issue22_no_step_total_loss_nan": seen(4, (1, 4), LOSS, nan=(3, LOSS)),
    "shintb_issue14_global_step_caps_nan": seen(
        1, (29003, 29003), LOSS, LR, nan=(29003, LOSS)
    ),  # "**LOSS : nan**"
    # "Loss is nan, stopping training" has no iteration: after the last, 150
    "torchvision_detection_issue244_loss_is_nan_stop": seen(5, (0, 151), LOSS, LR, nan=(151, LOSS)),
    # the stop line and the loss dict below it are the one failing iteration after 0
    "xview3_issue18_loss_dict_tensor_nan": seen(2, (0, 1), LOSS, LR, nan=(1, LOSS)),
    # epoch 12 (counted from 1) of 4468 steps
    "mindocr_issue670_epoch_step_brackets_healthy": seen(
        7, (11 * 4468 + 700, 11 * 4468 + 1300), LOSS, LR
    ),
    # epoch 3's iterations 220-300 and epoch 4's iteration 0, 308 an epoch (counted from 1);
    # the epoch summary's avg_loss is no step
    "pccai_issue1_batch_count_epoch_healthy": seen(6, (2 * 308 + 220, 3 * 308), LOSS),
    "modernbert_issue233_hf_dict_gradnorm_nan": seen(3, (1, 3), LOSS, GNORM, LR, nan=(1, GNORM)),
    "lite_mono_issue98_pipe_batch_healthy": seen(3, (0, 500), LOSS, LR),
    # Caffe: iterations 0 and 20; the "Train net output" lines are parts of iteration 0's loss
    "caffe_person_search_issue22_solver_loss_nan": seen(2, (0, 20), LOSS, LR, nan=(20, LOSS)),
    "ner_toolkit_issue1_current_loss_healthy": seen(18, (1, 171), LOSS),  # "current loss"
    # one table at step 1.53e+05 (loss nan), then five skips without a step, placed after it
    "guided_diffusion_issue50_kv_table_nan": seen(
        6, (153000, 153005), LOSS, SCALE, SKIP, nan=(153000, LOSS)
    ),
    "guided_diffusion_issue121_kv_table_healthy": seen(1, (3300, 3300), LOSS, GNORM),
    # a CSV that counts epochs: read in epochs; the loss is the sum of the train/ parts
    "ultralytics_gallstone_results_csv_healthy": seen(10, (1, 10), LOSS, LR),
    "ultralytics_drone_results_csv_healthy": seen(20, (1, 20), LOSS, LR),
    # Caffe iterations 0-300; the pinned loss is finite (1746.73 = 20 x 87.3365)
    "updown_captioner_issue2_caffe_loss_pinned": seen(4, (0, 300), LOSS, LR),
    # HF dicts without a bar: positions 1-10
    "grokfast_issue9_hf_gradnorm_geometric": seen(10, (1, 10), LOSS, GNORM, LR),
    # PPL only: its log is the loss; iterations counted on across epochs of 213
    "data2text_issue9_ppl_only_healthy": seen(12, (50, 2 * 213 + 200), LOSS, LR),
    "tablemaster_issue32_mmocr_gradnorm_nan": seen(
        2, (100, 200), LOSS, GNORM, LR, nan=(100, GNORM)
    ),
    "megatron_deepspeed_issue396_gradnorm_nan_no_loss": seen(
        3, (5426, 5428), GNORM, LR, SCALE, nan=(5426, GNORM)
    ),
    # fourth hunt (issue #32): chance level, runs broken from the start, short cascades
    # Keras: 50000 samples an epoch, epochs 34-42
    "keras_fractalnet_issue3_chance_level_stall": seen(
        9, (33 * 50000 + 50000, 41 * 50000 + 50000), LOSS, VAL
    ),
    # two iterations an optimizer step: 23 lines, steps 38-49 (each step twice)
    "litgpt_issue689_loss_at_ln_vocab": seen(23, (38, 49), LOSS),
    "openpi_issue814_loss_1e8_gradnorm_1e6": seen(17, (5900, 7500), LOSS, GNORM),
    # overflow lines without a step: positions 1-14 (the bar between them counts iterations)
    # 3 overflows before the bar's 22/150000 (placed just before it), then one skip a step
    "stylegan2_issue100_apex_cascade": seen(14, (19, 32), SCALE, SKIP),
    # epoch summaries at num_updates; each valid line (its epoch only) joins its summary
    "fairseq_issue506_epoch_summaries_healthy": seen(
        4, (17604, 18705), LOSS, GNORM, LR, SCALE, VAL
    ),
    # round 5 (issue #39, judging): a norm inf on every record; runs broken from the start; a
    # running average of the norm that holds an inf while the norm itself is finite
    "llm_degerlendirme_neftune_gradnorm_inf_every_step": seen(
        25, (3, 99), LOSS, GNORM, LR, nan=(3, GNORM)
    ),
    "zsd_sc_resolver_issue24_mmdet_loss_explodes": seen(4, (50, 200), LOSS, LR),
    "mmdet_issue3446_detectors_gradnorm_1e12_from_start": seen(2, (50, 100), LOSS, GNORM, LR),
    # epoch 29 of 300, 2859 iterations an epoch: iterations counted on across epochs
    "vmamba_issue273_gradnorm_avg_inf_healthy": seen(
        4, (28 * 2859 + 2670, 28 * 2859 + 2700), LOSS, GNORM, LR, SCALE
    ),
    # issue #39, reading half: structure and the trainers' words (unread or misread on 21ea598)
    "tf_estimator_icme_issue14_diverged_words": seen(1, (1, 1), LOSS, nan=(1, LOSS)),
    "t2t_issue106_transformer_big_diverged_words": seen(2, (31601, 31602), LOSS, nan=(31602, LOSS)),
    "t2t_vit_issue26_timm_summary_rows_nan": seen(12, (201, 212), LOSS, nan=(209, LOSS)),
    "tinygrad_pr13803_llama3_lr_warmup_flat_healthy": seen(10, (1, 10), LOSS, LR),
    "pleak_issue2_tensor_prints_nan": seen(17, (1, 17), LOSS, nan=(1, LOSS)),
    "objectgs_issue28_tensor_dict_healthy": seen(11, (86, 96), LOSS),
    "sid_issue117_bare_counts_nan": seen(11, (1, 11), LOSS, nan=(1, LOSS)),
    "dpo_issue42_string_dict_garbled_nan": seen(2, (1, 2), LOSS, GNORM, nan=(1, GNORM)),
    "efficientdet_issue328_plateau_lr_val_lines_healthy": seen(6, (121505, 122429), LOSS, LR, VAL),
}

# Read wrong for a reason no general rule settles yet (strict: a fix shows).
MISREAD = {
    "bigscience_tr8b_104B_resume_divergence": "each DeepSpeed 'OVERFLOW! Rank 0 Skipping step' "
    "line is a record of its own at the step of the iteration line after it (skipped, the new "
    "scale): 15 records for 9 iterations; the losses and scales are read right",
    "bmn_issue22_no_step_total_loss_nan": "'(epoch 0)' on every batch line is taken for the "
    "step: the four batches merge into one record at step 0 (later values win); the NaN is kept",
    "pccai_issue1_batch_count_epoch_healthy": "the iteration restarts each epoch and the epoch is "
    "printed only on lines of its own ('Training at epoch 4', the summary 'Epoch: 3/3'): read as "
    "steps 220-300, the summary as step 3, then 0, with two restarts",
    "caffe_person_search_issue22_solver_loss_nan": "Caffe's 'Train net output #k: loss_bbox = v "
    "(* 1 = v loss)' lines have their own time-of-day header and no step: one becomes a record "
    "at step 0 with its part as the loss, beside the solver's 'Iteration 0, loss = 89.1661'",
    "multiffn_nli_issue2_batches_nan": "'0 completed epochs, 100 batches': a count before its "
    "name is no step to a general rule (it reads 'epochs, 100'); read by position, 1-4",
    "pytorch_tutorial_zh_issue1_test_loss_healthy": "the step is named in Chinese (训练次数, "
    "'training count'): no counter name; read by position, 1-15",
}

LABELS = {
    case["id"]: case for case in map(json.loads, (REAL / "labels.jsonl").read_text().splitlines())
}


def read(name: str) -> list[StepRecord]:
    """The universal reader's records, or the CSV reader's for a CSV (no console log)."""
    path = REAL / "logs" / f"{name}.log"
    reader = CsvTableReader() if detect_format(path) == "csv" else UniversalReader()
    with open(path, "rb") as stream:
        return [item for item in reader.read(stream) if isinstance(item, StepRecord)]


# Issue #39's round-5 logs (labelled and scored at first sight) and the round's held-out set
# still wait for what a person reads in each: until their row joins SEEN, each is only read
# through, which must not raise.
PENDING = {
    name
    for name, case in LABELS.items()
    if case.get("added")
    in (
        "round5",
        "round5-holdout",
        "round6-holdout",
        "round7-holdout",
        "round8-holdout",
        "round8-holdout2",
        "round9-holdout",
        "round9-holdout2",
    )
} - set(SEEN)


def test_every_real_log_has_its_expectations() -> None:
    files = {path.stem for path in (REAL / "logs").glob("*.log")}
    assert set(SEEN) | PENDING == set(LABELS) == files
    assert sum(bool(case.get("added")) for case in LABELS.values()) >= 10


def _name(name: str) -> Any:
    miss = MISREAD.get(name)
    marks = [pytest.mark.xfail(reason=miss, strict=True)] if miss else []
    return pytest.param(name, id=name, marks=marks)


@pytest.mark.parametrize("name", [_name(name) for name in sorted(SEEN)])
def test_real_log_reads_as_a_person_reads_it(name: str) -> None:
    records, want = read(name), SEEN[name]
    steps = [r.step for r in records]
    assert (len(records), steps[0], steps[-1]) == (want.records, want.first, want.last)
    assert steps == sorted(steps), "steps never go back in these excerpts"
    printed = {key for r in records for key in r.values}
    assert want.keys <= printed
    first_bad = next(
        ((r.step, key) for r in records for key in sorted(want.keys) if _bad(r, key)), None
    )
    assert first_bad == want.nan


@pytest.mark.parametrize("name", sorted(PENDING))
def test_round5_log_reads_without_an_error(name: str) -> None:
    read(name)  # a bad line is skipped, never a traceback (an exception fails the test)


def _bad(record: StepRecord, key: str) -> bool:
    return key in record.values and not math.isfinite(record.values[key])


def test_lightning_bar_printed_twice_a_step_gives_the_fresh_loss() -> None:
    losses = [r.values[LOSS] for r in read("lightning_progressbar_issue4225_healthy")]
    assert losses == [10.473, 10.224, 10.047, 9.926, 9.847]


def test_hard_wrapped_megatron_lines_give_loss_norm_and_lr() -> None:
    first = read("bigscience_tr11_176B_throughput_drop")[0].values
    assert (first[LOSS], first[GNORM], first[LR]) == (2.117073, 0.150, 4.475e-05)


def test_overflow_lines_give_the_new_scale_each() -> None:
    probing = [r.values[SCALE] for r in read("deepspeed_issue931_startup_probing")]
    assert probing == [65536, 32768, 16384, 8192]  # the hysteresis overflow keeps 65536
    fairseq = read("fairseq_issue515_lightconv_scale_collapse")
    skipped = [(r.step, r.values[SCALE]) for r in fairseq if r.values.get(SKIP) == 1]
    assert [scale for _, scale in skipped] == [0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625]
    assert [step for step, _ in skipped] == [189, 388, 483, 484, 485]  # just before the update
    assert read("deepspeed_fused_optimizer_issue697_low_scale")[0].values == {SKIP: 1, SCALE: 4}


def test_the_total_loss_is_the_loss_not_a_part() -> None:
    assert read("detectron2_issue214_start_healthy")[0].values[LOSS] == 1.750  # total_loss
    assert read("styletts2_issue167_multi_loss_healthy")[0].values[LOSS] == 0.31109  # not LM Loss
    assert read("fairseq_issue512_overflow_cascade")[0].values[LOSS] == 6.343  # not nll_loss
    assert read("tf1_epos_step_total_loss_nan")[0].values[LOSS] == 9.5576973


def test_validation_losses_stay_apart() -> None:
    eval_step = read("nanogpt_issue215_fp16_nan_iter3010")[8]
    assert (eval_step.step, eval_step.values) == (3000, {LOSS: 4.2490, VAL: 4.0427})
    keras = read("keras_sentence_cnn_issue7_nan_epoch2")[0].values
    assert (keras[LOSS], keras[VAL]) == (0.6242, 0.5265)


def test_litgpt_micro_batches_keep_their_optimizer_step() -> None:
    records = read("litgpt_issue628_codellama_loss_jump")
    assert [r.values[LOSS] for r in records[:2]] == [1.7019, 11.4630]
    assert [r.step for r in records] == [144] * 8 + [145]
