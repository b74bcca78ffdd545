"""`MegatronReader`: both layouts, interval averages, NaN averages left off the line."""

from __future__ import annotations

import math
from pathlib import Path

from reader_cases import (
    findings,
    kinds,
    only_records,
    parse,
    parse_items,
    records,
    restarts,
    serious,
)

from stabilizer.replay.diagnose import diagnose
from stabilizer.replay.readers import Note

OLD = (
    " iteration      100/   50000 | consumed samples:        51200 | elapsed time per iteration "
    "(ms): 1234.5 | learning rate: 3.000E-04 | global batch size:   512 | lm loss: 3.141593E+00 | "
    "loss scale: 4096.0 | grad norm: 0.500 | number of skipped iterations:   0 | "
    "number of nan iterations:   0 |"
)
NEW_NAN = (
    "[2024-05-01 12:00:00] iteration      200/   50000 | consumed samples:       102400 | "
    "elapsed time per iteration (ms): 1234.5 | throughput per GPU (TFLOP/s/GPU): 180.3 | "
    "learning rate: 3.000000E-04 | global batch size:   512 | loss scale: 2048.0 | "
    "number of skipped iterations:   3 | number of nan iterations:   2 |"
)


def test_old_and_new_layouts_and_nan_interval() -> None:
    notes: list[Note] = []
    good, bad = parse("megatron", f"{OLD}\ntime (ms) | forward-compute: 400.1\n{NEW_NAN}\n", notes)
    assert good.step == 100 and good.values == {
        "lr": 3e-4, "loss": 3.141593, "loss_scale": 4096.0, "grad_norm": 0.5,
        "skipped_iterations": 0.0, "nan_iterations": 0.0, "skipped": 0.0,
    }  # fmt: skip
    assert bad.step == 200 and math.isnan(bad.values["loss"]) and bad.values["skipped"] == 1.0
    assert "grad_norm" not in bad.values
    assert [(n.kind, n.line) for n in notes] == [("format", 3)]
    assert "averages over the log interval of 100 iterations" in notes[0].message


def test_early_layout_without_colons() -> None:
    """Megatron-LM of 2019-20 printed ``| lm loss 1.020020E+01 |``, no colon."""
    line = (
        " iteration      100/   20000 | elapsed time per iteration (ms): 334.9 | learning rate "
        "1.010E-06 | lm loss 1.020020E+01 | nsp loss 5.515259E-01 |"
    )
    (record,) = parse("megatron", line, [])
    assert (record.step, record.values) == (100, {"loss": 10.2002, "lr": 1.01e-06})


def test_a_record_over_several_lines_is_one_record() -> None:
    text = (
        "iteration 5/50 | elapsed time per iteration: 21392.5 ms |\n"
        "learning rate: 1.350000E-04 | global batch size: 4096 |\n"
        "loss scale: 1.0 | grad norm: nan |\n"
        "number of skipped iterations: 0 | number of nan iterations: 0\n"
        "\n"
        "iteration 6/50 | elapsed time per iteration: 21313.4 ms | lm loss: 2.5 |\n"
        "time (ms) | forward-compute: 193.77 | backward-compute: 73.02\n"
        "lm loss: 9.9 | grad norm: 1.0 |\n"  # not right below its iteration line: not its
    )
    first, second = parse("megatron", text, [])
    assert first.step == 5 and math.isnan(first.values["grad_norm"])
    assert (first.values["lr"], first.values["skipped"]) == (1.35e-4, 0.0)
    assert "loss_scale" not in first.values  # 1.0 and never moved: no fp16 scaler
    assert second.step == 6 and second.values == {"loss": 2.5}


def test_a_loss_scale_that_never_leaves_one_is_no_scaler() -> None:
    """Issue #33: a bf16 run (``loss scale: 1.0`` on every line) with NaN iterations is no fp16
    overflow cascade; its scale is left out, with a note, until it moves (fp16 after all)."""
    bf16 = OLD.replace("loss scale: 4096.0", "loss scale: 1.0")
    nan = bf16.replace("lm loss: 3.141593E+00 | ", "").replace(
        "skipped iterations:   0 | number of nan iterations:   0",
        "skipped iterations:  10 | number of nan iterations:  10",
    )
    lines = [bf16.replace(" 100/", f" {step}/") for step in range(100, 600, 100)]
    lines += [nan.replace(" 100/", f" {step}/") for step in range(600, 1100, 100)]
    notes: list[Note] = []
    recs = parse("megatron", "\n".join(lines) + "\n", notes)
    assert all("loss_scale" not in r.values for r in recs)
    assert any("no fp16 scaler" in note.message for note in notes)
    assert kinds(findings(recs)) == {"nonfinite_loss"}
    moved = parse("megatron", OLD.replace("4096.0", "2.0") + "\n" + bf16 + "\n")
    assert [r.values["loss_scale"] for r in moved] == [2.0, 1.0]  # a scaler, at its floor


def test_healthy_fixture() -> None:
    recs = records("megatron_healthy.log")
    assert [r.step for r in recs[:3]] == [10, 20, 30] and len(recs) == 200
    assert recs[0].values["loss_scale"] == 131072.0 and recs[30].values["skipped"] == 1.0
    assert not serious(findings(recs))


def test_failing_fixture() -> None:
    recs = records("megatron_failing.log")
    assert all(math.isnan(r.values["loss"]) for r in recs[150:])
    assert kinds(findings(recs)) == {"nonfinite_loss", "fp16_overflow"}


def test_resume_banner_starts_a_segment() -> None:
    notes: list[Note] = []
    text = f"{OLD}\n loading checkpoint from /ckpt at iteration 100\n{OLD}\n"
    found = parse_items("megatron", text, notes)
    assert len(only_records(found)) == 2 and not notes
    assert restarts(found) == [
        (100, 3, "resume banner 'loading checkpoint from /ckpt at iteration 100'")
    ]


def test_layout_changes_restarts_and_odd_values() -> None:
    usual = OLD.replace("      100/", "{step:8d}/")
    nan_line = NEW_NAN.replace("      200/", "{step:8d}/")
    lines = [usual.format(step=s) for s in (10, 20, 30)]
    lines += [nan_line.format(step=s) for s in (40, 50)]  # another layout: no loss, no grad norm
    lines += [" loading checkpoint from /ckpt", usual.format(step=30), usual.format(step=40)]
    lines += [usual.format(step=20).replace("3.141593E+00", "nan")]  # the step goes back
    lines += [usual.format(step=30).replace("0.500", "inf").replace("lm loss: 3", "lm loss: x")]
    lines += [f"{usual.format(step=40)} lm loss: 9.0 | lm loss: 8.0 |"]  # the first one counts
    notes: list[Note] = []
    found = parse_items("megatron", "\n".join(lines) + "\n", notes)
    assert restarts(found) == [
        (30, 7, "resume banner 'loading checkpoint from /ckpt'"),
        (20, 9, "step went back from 40 to 20"),
    ]
    assert [(n.kind, n.line) for n in notes] == [("format", 2)]
    recs = only_records(found)
    assert [r.step for r in recs] == [10, 20, 30, 40, 50, 30, 40, 20, 30, 40]
    assert math.isnan(recs[3].values["loss"]) and "grad_norm" not in recs[3].values
    assert math.isnan(recs[7].values["loss"])
    assert recs[8].values["grad_norm"] == math.inf and "loss" not in recs[8].values
    assert recs[9].values["loss"] == 3.141593


def test_the_padded_vocabulary_rides_on_the_next_record() -> None:
    """``> padded vocab (size: 50257) with 47 dummy tokens (new size: 50304)``: chance level is
    ln of the vocabulary (`Stall`); the first record carries it, once."""
    text = " > padded vocab (size: 50257) with 47 dummy tokens (new size: 50304)\n" + OLD + "\n"
    text += OLD.replace("100/", "200/") + "\n"
    first, second = parse("megatron", text)
    assert first.values["vocab_size"] == 50257
    assert "vocab_size" not in second.values


def test_a_bf16_nan_stretch_is_no_overflow_and_no_advice_to_switch_to_bf16(tmp_path: Path) -> None:
    """Issue #33: a bf16 Megatron run (``loss scale: 1.0`` on every line) with NaN iterations:
    a NaN stretch, never "an fp16 overflow cascade, loss scale 1 -> 1 ... switch to bf16"."""
    bf16 = OLD.replace("loss scale: 4096.0", "loss scale: 1.0")
    nan = bf16.replace("lm loss: 3.141593E+00 | ", "").replace(
        "skipped iterations:   0 | number of nan iterations:   0",
        "skipped iterations:  10 | number of nan iterations:  10",
    )

    def finite(step: int) -> str:  # (a loss that moves, as a run's does: no frozen loss)
        loss = f"lm loss: {3.141593 - step / 1e5:.6E}"
        return bf16.replace(" 100/", f" {step}/").replace("lm loss: 3.141593E+00", loss)

    lines = [finite(step) for step in range(100, 1100, 100)]
    lines += [nan.replace(" 100/", f" {step}/") for step in range(1100, 1700, 100)]
    lines += [finite(step) for step in range(1700, 2000, 100)]
    path = tmp_path / "bf16.log"
    path.write_text("\n".join(lines) + "\n")
    found = [item.finding for item in diagnose(str(path)).findings]
    assert {f.kind for f in found} == {"nonfinite_loss"}
    assert not any("bf16" in f.message or "overflow" in f.message for f in found)


def test_deepspeeds_own_skip_marks_the_next_iteration_skipped() -> None:
    """Megatron-DeepSpeed in fp16: DeepSpeed skips the step and says so before the iteration's
    line, whose ``number of skipped iterations`` stays 0 (it counts Megatron's own skips only).
    A 1.3B LLaMA's run at its scale floor of 1 was read as no skip at all: no cascade."""
    iteration = (
        " iteration     {}/    2500 | learning rate: 1.371E-04 | lm loss: 1.267467E+01 | loss "
        "scale: 1.0 | grad norm: 2.265 | number of skipped iterations:   0 | number of nan "
        "iterations:   0 |\n"
    )
    said = (
        "[2023-08-15 07:22:30,556] [INFO] [logging.py:96:log_dist] [Rank 0] Overflow detected. "
        "Skipping step. Attempted loss scale: 1, reducing to 1\n"
    )
    text = iteration.format(2497) + said + iteration.format(2498) + iteration.format(2499)
    records = parse("megatron", text)
    assert [(r.step, r.values["skipped"]) for r in records] == [(2497, 0), (2498, 1), (2499, 0)]
