"""`HfTrainerReader` and `HfTrainerStateReader`: console dicts, ``log_history``, hidden NaN."""

from __future__ import annotations

import json
import math

from reader_cases import findings, kinds, parse, parse_items, records, serious

from stabilizer.core.records import Finding, StepRecord
from stabilizer.replay.readers import Note

CONSOLE = """\
***** Running training *****
 10%|█         | 50/500 [00:10<01:30,  5.00it/s]\r{'loss': 2.5, 'grad_norm': 0.9, \
'learning_rate': 0.0001, 'epoch': 0.5}
{'loss': 2.4, 'grad_norm': tensor(0.8, device='cuda:0'), 'learning_rate': np.float64(9e-05), \
'epoch': 0.6}
{'loss': nan, 'grad_norm': inf, 'learning_rate': 8e-05, 'epoch': 0.7}
{'eval_loss': 2.6, 'eval_runtime': 1.2, 'epoch': 0.7}
{'train_runtime': 100.0, 'train_samples_per_second': 10.0, 'train_loss': 2.45, 'epoch': 1.0}
"""


def test_console_dicts_never_evaluated() -> None:
    notes: list[Note] = []
    recs = parse(
        "hf_trainer", CONSOLE.replace(" 10%|█         | 50/500 [00:10<01:30,  5.00it/s]", ""), notes
    )
    assert recs[:2] == [
        StepRecord(1, {"loss": 2.5, "grad_norm": 0.9, "lr": 1e-4, "epoch": 0.5}),
        StepRecord(2, {"loss": 2.4, "grad_norm": 0.8, "lr": 9e-5, "epoch": 0.6}),
    ]
    assert recs[2].step == 3 and math.isnan(recs[2].values["loss"])  # a bare nan
    assert recs[3] == StepRecord(3, {"val_loss": 2.6, "eval_runtime": 1.2, "epoch": 0.7})
    assert len(recs) == 4  # the summary line, whose train_loss is a mean, is skipped
    assert [n.kind for n in notes] == ["format"]  # no bar: records count the dicts


def test_records_take_the_step_of_the_training_bar() -> None:
    """The bar printed since the record before numbers it (4711, not 3); without a new bar a
    record counts on; an evaluation's bar (another total) numbers nothing."""
    notes: list[Note] = []
    console = (
        " 39%|███▉      | 4710/12000 [1:02:03<1:36:01,  1.27it/s]\n"
        "{'loss': 2.1, 'grad_norm': 0.9, 'learning_rate': 1e-4, 'epoch': 0.39}\n"
        " 39%|███▉      | 4711/12000 [1:02:04<1:36:00,  1.27it/s]\r"
        "{'loss': 9.7, 'grad_norm': 40.0, 'learning_rate': 1e-4, 'epoch': 0.39}\n"
        "{'loss': 2.2, 'grad_norm': 1.0, 'learning_rate': 1e-4, 'epoch': 0.39}\n"
        " 80%|████████  | 40/50 [00:04<00:01,  9.10it/s]\n"
        "{'eval_loss': 2.6, 'eval_runtime': 5.2, 'epoch': 0.39}\n"
    )
    recs = parse("hf_trainer", console, notes)
    assert [r.step for r in recs] == [4710, 4711, 4712, 4712]
    assert recs[1].values["loss"] == 9.7 and recs[3].values == {
        "val_loss": 2.6,
        "eval_runtime": 5.2,
        "epoch": 0.39,
    }
    assert not notes  # numbered by the bar: no "records count log lines" note


def test_overflows_among_the_dicts_are_skipped_steps() -> None:
    """DeepSpeed (or apex) prints its fp16 overflows among the dicts, often glued to the bar."""
    console = (
        " 14%|█▍        | 378/2724 [13:58:09<86:18:35, 132.44s/it][2023-06-07 22:16:00,018] "
        "[INFO] [loss_scaler.py:181:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. "
        "Attempted loss scale: 64, reducing to 32\n"
        "\n"
        "{'loss': 2.0491, 'learning_rate': 0.0001961913563176343, 'epoch': 0.28}\n"
        "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 32, reducing to 16\n"
        "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 32, reducing to 16\n"
        "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 8.0\n"
        "[2021-11-27 00:36:54,800] [INFO] [stage2.py:1628:step] [deepscale] OVERFLOW! Rank 0 "
        "Skipping step. Attempted loss scale: 1, reducing to 1\n"
        "[2021-11-27 00:36:55,194] [INFO] [stage2.py:1628:step] [deepscale] OVERFLOW! Rank 0 "
        "Skipping step. Attempted loss scale: 1, reducing to 1\n"
    )
    recs = parse("hf_trainer", console, [])
    assert recs == [
        StepRecord(378, {"skipped": 1.0, "loss_scale": 32.0}),  # the bar's step
        StepRecord(379, {"loss": 2.0491, "lr": 0.0001961913563176343, "epoch": 0.28}),
        StepRecord(380, {"skipped": 1.0, "loss_scale": 16.0}),  # printed twice: one overflow
        StepRecord(381, {"skipped": 1.0, "loss_scale": 8.0}),  # apex says it so
        StepRecord(382, {"skipped": 1.0, "loss_scale": 1.0}),  # at the floor, step after step:
        StepRecord(383, {"skipped": 1.0, "loss_scale": 1.0}),  # rank 0 reports each, anew
    ]


def test_healthy_console_fixture() -> None:
    notes: list[Note] = []
    recs = records("hf_trainer_healthy.log", notes)
    assert recs[0].step == 10 and set(recs[0].values) == {"loss", "grad_norm", "lr", "epoch"}  # bar
    assert not serious(findings(recs))
    assert "hidden_nan" not in {n.kind for n in notes}


def test_failing_console_fixture_notes_hidden_nan() -> None:
    notes: list[Note] = []
    recs = records("hf_trainer_failing.log", notes)
    # The Trainer logged 0.0 beside a NaN norm: a window of NaN losses, read as the NaN it was.
    assert math.isnan(recs[210].values["loss"]) and math.isnan(recs[210].values["grad_norm"])
    assert kinds(findings(recs)) == {"nonfinite_loss"}
    hidden = [n.message for n in notes if n.kind == "hidden_nan"]
    assert len(hidden) == 1 and all("logging_nan_inf_filter" in m for m in hidden)


def test_repeated_losses_are_noted() -> None:
    notes: list[Note] = []
    parse("hf_trainer", "{'loss': 2.5}\n{'loss': 2.5}\n{'loss': 2.5}\n", notes)
    assert any("three times" in n.message for n in notes if n.kind == "hidden_nan")


def test_trainer_state_fixture() -> None:
    recs = records("hf_trainer_state_healthy")
    assert [r.step for r in recs[:3]] == [10, 20, 30] and len(recs) == 250
    assert recs[49].values.keys() >= {"loss", "grad_norm", "lr", "val_loss"}  # merged at 500
    assert not serious(findings(recs))
    assert kinds(findings(records("hf_trainer_state_failing"))) == {"loss_spike"}


def test_trainer_state_compact_and_nan() -> None:
    history = [{"loss": 2.0, "step": 1}, {"loss": float("nan"), "grad_norm": 1.0, "step": 2}]
    text = json.dumps({"best_metric": None, "log_history": history, "max_steps": 2})
    first, second = parse("hf_trainer_state", text)
    assert first == StepRecord(1, {"loss": 2.0}) and math.isnan(second.values["loss"])


def test_trainer_state_invalid_entry_stops_with_a_note() -> None:
    notes: list[Note] = []
    text = '{\n"log_history": [\n{"loss": 1, "step": 1},\n{"loss": }\n]\n}\n'
    assert parse("hf_trainer_state", text, notes) == [StepRecord(1, {"loss": 1.0})]
    assert [n.message for n in notes] == ["a log_history entry is not valid JSON: stopped"]


def _state(grads: list[float], first: int = 1, epoch: float = 0.0) -> str:
    """A ``trainer_state.json`` (indent=2, as the Trainer writes it) with one entry a step."""
    history = [
        {"epoch": epoch + i / 300, "grad_norm": g, "learning_rate": 5e-05, "loss": 2.5 - 0.01 * i,
         "step": first + i}
        for i, g in enumerate(grads)
    ]  # fmt: skip
    return json.dumps({"best_metric": None, "log_history": history}, indent=2, sort_keys=True)


def test_trainer_state_start_up_probing_is_no_nan() -> None:
    """Issue #32: ``grad_norm: NaN`` at steps 1-6 while the fp16 scaler probes (the loss
    finite), clean after: skipped steps and a note, no NaN finding, as the console readers read
    the overflows of DeepSpeed and apex. No public log of this shape was found (GitHub code and
    issue threads searched for trainer_state.json and HF log dicts with NaN norms at the first
    steps: committed trainer_state.json files log every 10-500 steps, past the probing), so the
    shape is written here as the Trainer writes it."""
    notes: list[Note] = []
    recs = parse("hf_trainer_state", _state([math.nan] * 6 + [1.2] * 20), notes)
    assert [r.values.get("skipped") for r in recs[:7]] == [1.0] * 6 + [None]
    assert "grad_norm" not in recs[0].values and recs[0].values["loss"] == 2.5
    assert any("start-up probing" in note.message for note in notes)
    assert not any(note.kind == "hidden_nan" for note in notes)
    assert serious(findings(recs)) == []


def test_hf_console_start_up_probing_is_no_nan() -> None:
    lines = [f"{{'loss': {2.5 - i / 100}, 'grad_norm': nan, 'epoch': {i / 300}}}" for i in range(4)]
    lines += [
        f"{{'loss': {2.4 - i / 100}, 'grad_norm': 1.1, 'epoch': {0.02 + i / 300}}}"
        for i in range(9)
    ]
    recs = parse("hf_trainer", "\n".join(lines) + "\n")
    assert serious(findings(recs)) == []


def test_what_is_no_start_up_probing() -> None:
    """NaN norms that last past step 32, last to the end, start mid-run (a late first step or a
    late epoch: ModernBERT#233 prints epoch 0.53), or come with a NaN loss stay NaN findings."""
    nan = math.nan
    cases = [
        _state([nan] * 40 + [1.2] * 3),
        _state([nan] * 3),
        _state([nan] * 3 + [1.2] * 3, first=500),
        _state([nan] * 3 + [1.2] * 3, epoch=0.53),
        _state([1.2] + [nan] * 3 + [1.2] * 3),
    ]
    for text in cases:
        assert kinds(findings(parse("hf_trainer_state", text))) == {"nonfinite_grad"}, text[:80]


def test_a_window_of_nan_losses_logged_as_zero_is_read_as_nan() -> None:
    """QwenLM/Qwen-VL#352: the loss 3.8462, then exactly 0.0 on every later record: the Trainer's
    NaN filter adds nothing for a NaN step, so a window of them logs 0. A real 0.0 beside a
    finite gradient norm (TRL GRPO's) stays."""
    hidden = (
        "{'loss': 3.8462, 'learning_rate': 3.4482758620689656e-07, 'epoch': 0.0}\n"
        "{'loss': 0.0, 'learning_rate': 6.896551724137931e-07, 'epoch': 0.01}\n"
    )
    first, second = parse("hf_trainer", hidden)
    assert first.values["loss"] == 3.8462 and math.isnan(second.values["loss"])
    real = (
        "{'loss': 0.0153, 'grad_norm': 0.0865, 'learning_rate': 6.9e-06, 'epoch': 0.31}\n"
        "{'loss': 0.0, 'grad_norm': 0.0966, 'learning_rate': 6.7e-06, 'epoch': 0.33}\n"
    )
    assert [r.values["loss"] for r in parse("hf_trainer", real)] == [0.0153, 0.0]


def test_a_message_that_reports_trouble_among_the_dicts_is_said() -> None:
    """DeepSpeed's exit at the floor of its loss scale, printed into the Trainer's console
    (ymcui/Chinese-LLaMA-Alpaca#534's title): a finding that the trainer said it."""
    text = (
        "{'loss': 2.0491, 'learning_rate': 0.0001961913563176343, 'epoch': 0.28}\n"
        "Exception: Current loss scale already at minimum - cannot decrease scale anymore. "
        "Exiting run.\n"
    )
    said = [item for item in parse_items("hf_trainer", text) if isinstance(item, Finding)]
    assert [(f.kind, f.step) for f in said] == [("trainer_said", 1)]


def test_ms_swift_dicts_count_their_step_in_a_string() -> None:
    """ms-swift's dicts carry ``'global_step/max_steps': '105/250250'``: that is the step, not
    the bar's count (ms-swift#2391: its NaN gradient norm had been placed at 151, not 105)."""
    text = (
        "Train:   0%|          | 150/250250 [4:46:55<156:07:10,  2.25s/it]"
        "{'eval_loss': nan, 'epoch': 0.0, 'global_step/max_steps': '100/250250'}\n"
        "{'loss': 0.0, 'grad_norm': nan, 'learning_rate': 8.4e-07, 'epoch': 0.0, "
        "'global_step/max_steps': '105/250250', 'percentage': '0.04%'}\n"
    )
    assert [r.step for r in parse("hf_trainer", text)] == [100, 105]


def test_a_step_printed_before_the_dict_is_its_step() -> None:
    """text-generation-webui's training tab prints ``Step:      3 {'loss': ...}`` every 4
    steps: the records were numbered 1, 2, 3 by their lines (a finding at "step 1" of a run
    whose first logged step is 3)."""
    text = (
        "Step:      3 {'loss': 2.4395, 'grad_norm': inf, 'learning_rate': 8e-06, 'epoch': 0.02}\n"
        "Step:      7 {'loss': 2.4141, 'grad_norm': inf, 'learning_rate': 1.6e-05, 'epoch': 0.04}\n"
    )
    assert [r.step for r in parse("hf_trainer", text)] == [3, 7]
