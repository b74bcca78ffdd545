"""The ``stabilizer`` command, through click's CliRunner."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from stabilizer import __version__
from stabilizer.cli import main
from stabilizer.core.run import RunHeader
from stabilizer.replay.readers import read_log


def test_help_lists_commands() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    assert "demo" in result.output


def test_demo_trains_and_writes_tensorboard_logs(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = CliRunner().invoke(
            main,
            [
                "demo",
                "--steps",
                "20",
                "--device",
                "cpu",
                "--log-dir",
                str(tmp_path),
                "--sample",
                "40",
                "--policy",
                "observe",
            ],
        )
    assert result.exit_code == 0, result.output
    assert "healthy: 20 steps in" in result.output
    # The monitor ran: a healthy start finds nothing wrong, only the preflight's note on clipping.
    assert "findings: none\nset-up notes: 1\n  step 0 info config_risk" in result.output
    assert "--- sample ---" in result.output
    events = list((tmp_path / "healthy").rglob("events.out.tfevents.*"))
    assert events, result.output
    # The log opens with the run's facts, the policy the command line asked for among them.
    [jsonl] = (tmp_path / "healthy").rglob("stability.jsonl")
    [header, *_] = read_log(jsonl)
    assert header == RunHeader(
        "32-true", "cpu", 1, "SingleDeviceStrategy", 1, "observe", header.groups, __version__
    )
    assert header.groups == ("embed", "block_00", "block_01", "block_02", "block_03", "head")


def test_demo_bad_data_is_a_usage_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    result = CliRunner().invoke(main, ["demo", "--data", str(empty)])
    assert result.exit_code == 2
    assert "data file is empty" in result.output
    assert "Traceback" not in result.output


def test_demo_refuses_a_binary_data_file(tmp_path: Path) -> None:
    """#41: ``demo --data`` trained on a binary file and printed raw bytes as its sample."""
    binary = tmp_path / "python"
    binary.write_bytes(Path(sys.executable).resolve().read_bytes()[:4096])
    result = CliRunner().invoke(main, ["demo", "--data", str(binary)])
    assert result.exit_code == 2
    assert f"data file is binary, expected a text file: {binary}" in result.output
    assert "Traceback" not in result.output
    latin = tmp_path / "latin.txt"  # any text is a corpus: Latin-1 too
    latin.write_bytes("déjà vu, où est la gare ? ".encode("latin-1") * 100)
    args = ["demo", "--data", str(latin), "--steps", "2", "--device", "cpu", "--sample", "0"]
    result = CliRunner().invoke(main, [*args, "--log-dir", str(tmp_path / "runs")])
    assert result.exit_code == 0, result.output


def test_demo_unknown_scenario_lists_choices() -> None:
    result = CliRunner().invoke(main, ["demo", "--scenario", "boom"])
    assert result.exit_code == 2
    assert "'healthy', 'spike'" in result.output


def test_demo_on_a_device_the_machine_lacks_is_one_line() -> None:
    """#33: ``--device cuda`` without CUDA was a 38-line traceback and exit 1."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = CliRunner().invoke(main, ["demo", "--device", "cuda", "--sample", "0"])
    assert result.exit_code == 2, result.output
    assert "this machine has no CUDA GPU: use --device cpu or auto" in result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)


def test_demo_on_a_users_text_logs_under_its_name(tmp_path: Path) -> None:
    """#33: ``--data FILE`` wrote under runs/healthy/, as if it were the stdlib run."""
    text = tmp_path / "my_text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    args = ["demo", "--data", str(text), "--steps", "3", "--device", "cpu", "--sample", "0"]
    result = CliRunner().invoke(main, [*args, "--log-dir", str(tmp_path / "runs")])
    assert result.exit_code == 0, result.output
    assert list((tmp_path / "runs" / "healthy-my_text").rglob("stability.jsonl"))
    assert not (tmp_path / "runs" / "healthy").exists()


@pytest.mark.usefixtures("one_thread")
def test_the_demo_of_a_nan_says_that_protect_kept_it_alive(tmp_path: Path) -> None:
    """#33: ``nan-16-true`` trained on after its NaN and never said why; the finding list reads
    as the reports advise it; no Lightning deprecation between the lines; the TensorBoard
    command is one this environment runs."""
    args = ["demo", "--scenario", "nan-16-true", "--steps", "66", "--device", "cpu"]
    done = subprocess.run(
        [sys.executable, "-c", "from stabilizer.cli import main; main()", *args, "--sample", "0"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "protect: 4 steps went NaN/Inf and the guard skipped them: the weights stayed " in (
        done.stdout
    )
    assert "LeafSpec" not in done.stderr
    view = done.stdout.split("(view: ")[1].split(")")[0]
    program = view.split()[0]
    assert program == "tensorboard" or Path(program).is_file(), view
    # A NaN the guard skipped, in a run that went on: no "skip the step", no "roll back".
    [nan] = [line for line in done.stdout.splitlines() if "error nonfinite_loss" in line]
    assert nan.endswith("-> try: upcast_to_fp32"), nan


def test_the_tensorboard_command_names_the_venvs_program(monkeypatch: pytest.MonkeyPatch) -> None:
    from stabilizer.outputs.event_file import tensorboard_command

    monkeypatch.setenv("PATH", "/nonexistent")  # the venv is not activated
    program = tensorboard_command(Path("runs")).split()[0]
    assert program.endswith("tensorboard") and Path(program).is_file()
    assert tensorboard_command(Path("runs")).endswith(" --logdir runs")


def _demo(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run(
        [sys.executable, "-c", "from stabilizer.cli import main; main()", "demo", *args,
         "--device", "cpu", "--sample", "0"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_the_demo_of_a_run_the_guard_stopped_says_so(tmp_path: Path) -> None:
    """#41: softmax-fp16 (NaN from step ~31, stopped after 10 in a row) was told "the weights
    stayed finite, so the run trained on"; its set-up notes were counted as findings."""
    done = _demo(tmp_path, "--scenario", "softmax-fp16")
    assert "the guard skipped them, then stopped the run at step " in done.stdout
    assert "trained on" not in done.stdout
    findings = done.stdout.split("findings: ")[1].split("set-up notes: ")
    assert "config_risk" not in findings[0] and "config_risk" in findings[1]
    stop = [i for i, line in enumerate(done.stderr.splitlines()) if "stopping at step" in line]
    assert done.stderr.splitlines()[stop[0] + 1].startswith("stabilizer: done at step")


def test_the_healthy_demo_is_healthy_and_takes_one_thread(tmp_path: Path) -> None:
    """#41: the healthy demo's end line said "1 finding (1 info)" (its set-up note) where the
    README and `diagnose` say healthy; on a loaded CPU its steps took 12x longer with the
    default threads than with one."""
    done = _demo(tmp_path, "--steps", "5")
    assert "cpu: 1 torch thread" in done.stdout
    [end] = [line for line in done.stderr.splitlines() if line.startswith("stabilizer: done")]
    assert "healthy, no findings; 1 set-up note (1 info); 0 steps skipped" in end
    assert "findings: none" in done.stdout and "set-up notes: 1" in done.stdout
