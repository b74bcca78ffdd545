"""W&B: run files (``run-*.wandb``, run folders) and CSV exports give the console log's findings."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from reader_cases import only_records, parse_items
from tracker_cases import RUNS, TRACKERS, console_findings, findings, no_network

from stabilizer.cli import main
from stabilizer.replay.readers import LogReadError, Note, Restart, detect_format, read_log
from stabilizer.replay.readers.trackers.leveldb import BLOCK, MAGIC
from stabilizer.replay.watch import Watch

__all__ = ["no_network"]  # the fixture, used by name

WANDB = TRACKERS / "wandb"


def _wandb() -> None:
    pytest.importorskip("wandb.proto.wandb_internal_pb2", reason="the wandb extra")


@pytest.mark.parametrize("run", RUNS)
def test_a_run_file_gives_the_console_logs_findings(
    run: str, tmp_path: Path, no_network: list[object]
) -> None:
    _wandb()
    assert detect_format(WANDB / f"{run}.wandb") == "wandb"
    assert findings(WANDB / f"{run}.wandb") == console_findings(run, tmp_path)


def test_the_steps_are_the_trainers_and_eval_rows_stay_apart() -> None:
    """``_step`` counts log calls (the eval rows too); ``train/global_step`` is the step."""
    _wandb()
    notes: list[Note] = []
    records = only_records(list(read_log(WANDB / "healthy.wandb", notes=notes)))
    assert [r.step for r in records] == list(range(1, 121))
    assert records[24].values["eval/loss"] > 0 and "loss" in records[24].values
    assert all("eval/loss" not in r.values for r in records if r.step % 25)
    assert any("W&B run healthy" in n.message for n in notes)


@pytest.mark.parametrize("run", RUNS)
def test_a_history_csv_gives_the_console_logs_findings(run: str, tmp_path: Path) -> None:
    path = WANDB / f"history-{run}.csv"
    assert detect_format(path) == "wandb_csv"
    assert findings(path) == console_findings(run, tmp_path)


def test_a_panel_of_two_runs_is_two_runs(tmp_path: Path) -> None:
    """Side by side, ``__MIN``/``__MAX`` left out; ``diagnose`` reports each run."""
    panel = WANDB / "panel.csv"
    for run in ("spike", "healthy"):
        assert findings(f"{panel}#{run}") == console_findings(run, tmp_path, loss_only=True)
    result = CliRunner().invoke(main, ["diagnose", str(panel)])
    assert f"diagnosis of {panel}#spike" in result.output
    assert f"diagnosis of {panel}#healthy" in result.output
    assert result.exit_code == 1  # the spike
    missing = CliRunner().invoke(main, ["diagnose", f"{panel}#other"])
    assert missing.exit_code == 2 and "no run 'other'" in missing.output


def _write_run(folder: Path, nan_from: int, steps: int = 40) -> None:
    """A real offline run in ``folder/wandb``, in a process of its own."""
    script = (
        "import math, wandb\n"
        f"run = wandb.init(project='p', dir={str(folder)!r})\n"
        f"for s in range(1, {steps + 1}):\n"
        f"    run.log({{'trainer/global_step': s, 'train_loss': math.nan if s >= {nan_from} "
        "else 3 - 0.01 * s})\n"
        "run.finish()\n"
    )
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)


def test_a_run_folder_its_latest_run_and_a_folder_of_runs(tmp_path: Path) -> None:
    """Lightning's ``WandbLogger`` names (``trainer/global_step``, ``train_loss``)."""
    _wandb()
    _write_run(tmp_path, nan_from=30)
    _write_run(tmp_path, nan_from=1000)
    folder = tmp_path / "wandb"
    latest = findings(folder / "latest-run")
    assert latest == []  # the newest, healthy run
    result = CliRunner().invoke(main, ["diagnose", str(folder)])
    assert result.output.count("diagnosis of") == 2 and "latest-run" not in result.output
    assert "non-finite loss" in result.output and result.exit_code == 1


def _damaged(data: bytes, at: int) -> bytes:
    flipped = bytearray(data)
    flipped[at] ^= 0xFF
    return bytes(flipped)


def test_crcs_are_checked_and_damage_skips_to_the_next_block(tmp_path: Path) -> None:
    _wandb()
    data = (WANDB / "healthy.wandb").read_bytes()
    assert len(data) > BLOCK  # records cross blocks
    whole = only_records(list(read_log(WANDB / "healthy.wandb")))
    path = tmp_path / "run-x.wandb"
    path.write_bytes(_damaged(data, BLOCK // 2))
    notes: list[Note] = []
    records = only_records(list(read_log(path, notes=notes)))
    assert any("CRC" in n.message or "known type" in n.message for n in notes)
    kept = {r.step for r in records}
    assert 1 in kept and 120 in kept and kept < {r.step for r in whole}


@pytest.mark.parametrize("cut", [9, 1000, BLOCK - 3, BLOCK + 5, 50_000])
def test_a_torn_last_record_is_the_end_not_an_error(tmp_path: Path, cut: int) -> None:
    _wandb()
    data = (WANDB / "spike.wandb").read_bytes()
    path = tmp_path / "run-x.wandb"
    path.write_bytes(data[:cut])
    notes: list[Note] = []
    records = only_records(list(read_log(path, notes=notes)))
    assert [r.step for r in records] == list(range(1, len(records) + 1))
    assert any("cut short" in n.message for n in notes)


def test_not_a_run_file_is_one_line(tmp_path: Path) -> None:
    _wandb()
    path = tmp_path / "run-x.wandb"
    path.write_bytes(b"\x00\x01garbage" * 100)
    with pytest.raises(LogReadError, match="no W&B header"):
        list(read_log(path, format="wandb"))
    assert MAGIC.startswith(b":W&B")


def test_without_the_extra_one_line_names_it(tmp_path: Path) -> None:
    script = (
        "import sys; sys.modules['wandb'] = None\n"
        "from stabilizer.cli import main\n"
        f"main(['diagnose', {str(WANDB / 'nan.wandb')!r}])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "stabilizer diagnose: error: reading a W&B run file (.wandb) needs the wandb extra: "
        "pip install 'stabilizer-lightning[wandb]'"
    ]


def test_watch_follows_a_growing_run_file(tmp_path: Path) -> None:
    """Written a piece at a time, records cut across pieces: the findings of diagnose."""
    _wandb()
    data = (WANDB / "nan.wandb").read_bytes()
    path = tmp_path / "run-x.wandb"
    path.write_bytes(data[:4000])
    alerts: list[str] = []
    watch = Watch([str(path)], lambda alert: alerts.append(alert.finding.kind), poll=0.02)

    def grow() -> None:
        for end in range(4000, len(data) + 7919, 7919):
            time.sleep(0.05)
            with open(path, "ab") as file:
                file.write(data[end : end + 7919])
        time.sleep(0.5)
        watch.stop()

    thread = threading.Thread(target=grow)
    thread.start()
    (outcome,) = watch.run()
    thread.join()
    assert "nonfinite_loss" in alerts
    kept = [(f.finding.kind, f.finding.step) for f in outcome.findings]  # type: ignore[union-attr]
    assert kept == [(kind, step) for kind, step, _, _ in findings(WANDB / "nan.wandb")]
    items = list(read_log(path))
    assert not any(isinstance(item, Restart) for item in items)


HISTORY = "_step,_runtime,train/loss,train/global_step,eval/loss\n"


def test_a_resumed_run_restarts_where_a_metric_is_logged_again() -> None:
    """Steps 1-5, then a resume from step 3: one restart, the steps as logged."""
    rows = [f"{i},0,{2 + i / 10},{step},\n" for i, step in enumerate([1, 2, 3, 4, 5, 3, 4])]
    items = parse_items("wandb_csv", HISTORY + "".join(rows))
    restarts = [item for item in items if isinstance(item, Restart)]
    assert [r.step for r in restarts] == [3] and "went back from 5 to 3" in restarts[0].why
    assert [r.step for r in only_records(items)] == [1, 2, 3, 4, 5, 3, 4]


def test_a_row_on_another_clock_is_left_out_with_a_note() -> None:
    """A metric logged against the epoch (1, 2) among steps 10, 20, 30: no restart."""
    text = "_step,train/loss,global_step,epoch_loss\n0,2.5,10,\n1,2.4,20,\n2,,1,2.45\n3,2.3,30,\n"
    notes: list[Note] = []
    items = parse_items("wandb_csv", text, notes)
    assert not any(isinstance(item, Restart) for item in items)
    assert [r.step for r in only_records(items)] == [10, 20, 30]
    assert any("behind the run's" in n.message for n in notes)


def test_an_eval_row_without_the_counter_is_at_the_last_step() -> None:
    text = HISTORY + "0,0,2.5,10,\n1,0,,,2.9\n2,0,2.4,11,\n"
    records = only_records(parse_items("wandb_csv", text))
    assert [(r.step, r.values.get("loss"), r.values.get("eval/loss")) for r in records] == [
        (10, 2.5, 2.9),
        (11, 2.4, None),
    ]


@pytest.mark.parametrize("between", [b"", b"\n"])
def test_a_newer_run_file_after_the_first_starts_over(tmp_path: Path, between: bytes) -> None:
    """What a followed folder hands over when its newest run changes: the old file to its end,
    (a line break where the old file did not end one), the new file from its header."""
    _wandb()
    path = tmp_path / "run-x.wandb"
    path.write_bytes(
        (WANDB / "healthy.wandb").read_bytes() + between + (WANDB / "nan.wandb").read_bytes()
    )
    items = list(read_log(path))
    restarts = [item for item in items if isinstance(item, Restart)]
    assert [r.step for r in restarts] == [1]
    assert [r.step for r in only_records(items)] == [*range(1, 121), *range(1, 121)]
