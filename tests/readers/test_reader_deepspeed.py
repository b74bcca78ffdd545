"""`DeepSpeedReader`: overflow lines become skipped steps the fp16 detector can judge."""

from __future__ import annotations

from reader_cases import findings, kinds, parse, parse_items, records, serious

from stabilizer.core.engine import Engine
from stabilizer.core.records import Finding, Severity, StepRecord

LOG = """\
[2024-05-01 12:00:00,100] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 \
Skipping step. Attempted loss scale: 65536, reducing to 32768
[2024-05-01 12:00:00,150] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 1 \
Skipping step. Attempted loss scale: 65536, reducing to 32768
[2024-05-01 12:00:01,000] [INFO] [logging.py:96:log_dist] [Rank 0] step=10, skipped=1, \
lr=[0.0001, 0.0001], mom=[(0.9, 0.999)]
[2024-05-01 12:00:01,000] [INFO] [engine.py:2178:_report_progress] steps: 10 loss: 2.3456 iter \
time (s): 0.512 samples/sec: 62.5
[2024-05-01 12:00:02,200] [INFO] [loss_scaler.py:190:update_scale] [deepspeed] OVERFLOW! Rank 0 \
Skipping step. Attempted loss scale: 32768, but hysteresis is 2. Reducing hysteresis to 1
[2026-06-18 23:36:56,643] [INFO] [unfused_optimizer.py:281:_update_scale] Grad overflow on \
iteration: 14
[2026-06-18 23:36:56,643] [INFO] [unfused_optimizer.py:207:step] [deepspeed] fp16 dynamic loss \
scale overflow! Skipping step. Attempted loss scale: 32768.0, reducing to 16384.0
[2024-05-01 12:00:03,000] [INFO] [logging.py:96:log_dist] [Rank 0] step=20, skipped=3, \
lr=[0.0001], mom=[(0.9, 0.999)]
"""


def test_overflow_variants_and_progress() -> None:
    assert parse("deepspeed", LOG) == [
        StepRecord(1, {"skipped": 1.0, "loss_scale": 65536.0}),  # rank 1's line is ignored
        StepRecord(10, {"lr": 1e-4, "skipped": 0.0, "loss_scale": 32768.0}),
        StepRecord(10, {"loss": 2.3456}),
        StepRecord(11, {"skipped": 1.0, "loss_scale": 32768.0}),  # hysteresis: scale holds
        StepRecord(15, {"skipped": 1.0, "loss_scale": 32768.0}),  # placed by its iteration
        StepRecord(20, {"lr": 1e-4, "skipped": 0.0, "loss_scale": 16384.0}),
    ]


def test_an_overflow_glued_to_a_progress_bar_is_at_its_count() -> None:
    """The HF Trainer under DeepSpeed: tqdm's bar, then the scaler's line on the same line
    (Chinese-LLaMA-Alpaca-2#97: placed at steps 1 and 2 where the bar said 94 and 95)."""
    overflow = (
        "[2023-08-07 18:38:05,632] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] "
        "OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 0, reducing to 0"
    )
    bar = "  0%|          | {}/97976 [1:27:41<1515:27:58, 55.74s/it]"
    text = f"{bar.format(94)}{overflow}\n{bar.format(95)}{overflow}\n"
    assert [r.step for r in parse("deepspeed", text)] == [94, 95]


def test_healthy_fp16_run_is_healthy_through_the_engine() -> None:
    recs = records("deepspeed_healthy.log")
    skipped = [r.step for r in recs if r.values.get("skipped") == 1.0]
    # start-up, then once every ~1000 steps (at 500, 1500, 2500: placed after the last progress
    # line, a lower bound)
    assert skipped == [1, 2, 3, 491, 1491, 2491]
    found = Engine().replay(recs)
    assert not serious(found), found


def test_failing_fixture_is_an_overflow_cascade() -> None:
    recs = records("deepspeed_failing.log")
    assert recs[-1].values == {"skipped": 1.0, "loss_scale": 1.0}
    assert kinds(findings(recs)) == {"fp16_overflow"}


def test_the_first_rank_that_reports_is_read_once_per_overflow() -> None:
    """One overflow line per rank, and no rank 0 among them (a pipeline's last stage prints
    them): one skipped step per overflow, not none (the unchanged code read rank 0's only) and
    not one per rank."""
    lines = [
        f"[2023-05-01 10:00:0{k},000] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] "
        f"OVERFLOW! Rank {rank} Skipping step. Attempted loss scale: {2 ** (16 - k)}, reducing "
        f"to {2 ** (15 - k)}"
        for k in range(3)
        for rank in (3, 1, 2)
    ]
    recs = parse("deepspeed", "\n".join(lines) + "\n")
    assert [r.values["loss_scale"] for r in recs] == [65536.0, 32768.0, 16384.0]


def test_the_scale_at_its_floor_is_said() -> None:
    text = (
        "[2023-06-07 22:24:46,260] [INFO] [loss_scaler.py:181:update_scale] [deepspeed] OVERFLOW! "
        "Rank 0 Skipping step. Attempted loss scale: 1, reducing to 1\n"
        "Exception: Current loss scale already at minimum - cannot decrease scale anymore. "
        "Exiting run.\n"
    )
    found = [item for item in parse_items("deepspeed", text) if isinstance(item, Finding)]
    assert [(f.kind, f.severity, f.step) for f in found] == [("trainer_said", Severity.ERROR, 1)]
