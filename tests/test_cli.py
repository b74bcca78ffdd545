"""The ``stabilizer`` command, through click's CliRunner."""

from __future__ import annotations

import warnings
from pathlib import Path

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
    assert "findings: 1\n  step 0 info config_risk" in result.output
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


def test_demo_unknown_scenario_lists_choices() -> None:
    result = CliRunner().invoke(main, ["demo", "--scenario", "boom"])
    assert result.exit_code == 2
    assert "'healthy', 'spike'" in result.output
