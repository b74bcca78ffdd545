"""``stabilizer diagnose`` outputs: never clobber, never through a link, checked before reading.

Each test here failed on the code before issue #15's fixes (the plot overwrote and followed
links, the TensorBoard export merged into run directories and reopened its file per batch,
out-of-range steps crashed both outputs with exit 1, a full stdout gave a traceback).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from stabilizer.cli import main
from stabilizer.core.records import StepRecord
from stabilizer.replay.readers import read_log
from stabilizer.report import session

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "tests" / "fixtures" / "logs"
HOSTILE = ROOT / "tests" / "fixtures" / "hostile"
NANOGPT = LOGS / "nanogpt_failing.log"  # one loss spike (warning): exit 1
HEALTHY = LOGS / "nanogpt_healthy.log"
TB_RUN = LOGS / "tensorboard_failing"  # per-layer norms; version_0/events.out.tfevents.*
MEGATRON = ROOT / "examples" / "logs" / "megatron_gpt345m.log"  # 307 records
PNG = b"\x89PNG\r\n\x1a\n"


def run(*args: str | Path) -> Result:
    result = CliRunner().invoke(main, ["diagnose", *map(str, args)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    return result


def events(directory: Path) -> list[Path]:
    return sorted(directory.rglob("events.out.tfevents.*"))


def scalars(directory: Path, tag: str) -> list[tuple[int, float]]:
    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


# --- --plot: never replaces a file, never writes through a link, unless --force ----------------


def test_plot_refuses_to_replace_a_file(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    picture = tmp_path / "run.png"
    picture.write_bytes(b"my own picture")
    result = run(NANOGPT, "--plot", picture)
    assert result.exit_code == 2
    assert result.stdout == ""  # refused before the log was read
    assert result.stderr == (
        f"stabilizer diagnose: error: {picture}: a file is there already; "
        "pass --force to replace it\n"
    )
    assert picture.read_bytes() == b"my own picture"


def test_plot_with_force_replaces_the_file(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    picture = tmp_path / "run.png"
    picture.write_bytes(b"an old picture")
    result = run(NANOGPT, "--plot", picture, "--force")
    assert result.exit_code == 1
    assert picture.read_bytes().startswith(PNG)
    assert [p.name for p in tmp_path.iterdir()] == ["run.png"]  # no temporary file left


@pytest.mark.skipif(os.name != "posix", reason="symbolic links")
@pytest.mark.parametrize("force", [False, True], ids=["refused", "force-replaces-the-link"])
def test_plot_never_writes_through_a_symbolic_link(tmp_path: Path, force: bool) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    link = tmp_path / "run.png"
    link.symlink_to(target)
    result = run(NANOGPT, "--plot", link, *(["--force"] if force else []))
    assert target.read_text() == "keep me"
    if force:  # the link itself is replaced by the picture; its target is untouched
        assert result.exit_code == 1
        assert not link.is_symlink() and link.read_bytes().startswith(PNG)
    else:
        assert result.exit_code == 2
        assert "a symbolic link is there already; pass --force" in result.stderr
        assert link.is_symlink()


@pytest.mark.skipif(os.name != "posix", reason="symbolic links")
def test_plot_with_a_dangling_link_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    link = tmp_path / "run.png"
    link.symlink_to(tmp_path / "created-through-the-link.png")
    result = run(NANOGPT, "--plot", link)
    assert result.exit_code == 2
    assert not (tmp_path / "created-through-the-link.png").exists()


def test_plot_onto_an_input_is_refused_even_with_force(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    log = tmp_path / "train.log"
    shutil.copy(NANOGPT, log)
    result = run(log, "--plot", log, "--force")
    assert result.exit_code == 2
    assert f"{log}: is one of the inputs" in result.stderr
    assert log.read_bytes() == NANOGPT.read_bytes()


# --- output paths are checked before any input is read -----------------------------------------


def test_plot_without_extension_and_two_inputs_numbers_the_files(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = run(NANOGPT, HEALTHY, "--plot", tmp_path / "noext")
    assert result.exit_code == 1, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["noext-1", "noext-2"]
    assert (tmp_path / "noext-2").read_bytes().startswith(PNG)


def _never_read(path: str, format: str, **kwargs: object) -> None:
    raise AssertionError(f"{path} was read before the outputs were checked")


@pytest.mark.parametrize("output", ["--plot", "--tensorboard"])
def test_a_bad_output_fails_before_any_input_is_read(
    tmp_path: Path, output: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(session, "diagnose", _never_read)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "run-2.png").write_bytes(b"x")  # the second input's picture
    (taken / "file").write_text("x")  # the TensorBoard directory holds something
    target = taken / "run.png" if output == "--plot" else taken
    result = run(NANOGPT, HEALTHY, output, target)
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "pass --force" in result.stderr


# --- --tensorboard: one file, opened once; never into a non-empty directory unless --force ------


def test_tensorboard_event_file_is_opened_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[str] = []
    real_open, real_os_open = open, os.open

    def spy_open(file: object, *args: object, **kwargs: object) -> object:
        opened.append(str(file))
        return real_open(file, *args, **kwargs)  # type: ignore[call-overload]

    def spy_os_open(path: str, *args: object, **kwargs: object) -> int:
        opened.append(str(path))
        return real_os_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr("builtins.open", spy_open)
    monkeypatch.setattr("io.open", spy_open)
    monkeypatch.setattr(os, "open", spy_os_open)
    result = run(MEGATRON, "--tensorboard", tmp_path / "tb")
    monkeypatch.undo()
    assert result.exit_code == 1
    [written] = events(tmp_path / "tb")
    assert [name for name in opened if "tfevents" in name] == [str(written)]
    stream = read_log(tmp_path / "tb")
    assert sum(isinstance(item, StepRecord) for item in stream) == 307  # both segments


def test_several_inputs_into_tensorboard_say_one_command_for_their_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """#41: ``diagnose A B --tensorboard DIR`` suggested a bare ``tensorboard`` (not on PATH
    without the venv) and one ``--logdir`` per run instead of DIR, where every run is."""
    monkeypatch.setenv("PATH", "/nonexistent")  # the venv is not activated
    tb = tmp_path / "tb"
    result = run(MEGATRON, NANOGPT, "--tensorboard", tb)
    views = [line for line in result.stderr.splitlines() if "--logdir" in line]
    assert len(views) == 1 and views[0].endswith(f" --logdir {tb}"), result.stderr
    program = views[0].split("view: ")[1].split()[0]
    assert Path(program).is_file(), program
    assert sorted(path.name for path in tb.iterdir()) == [
        "1-megatron_gpt345m.log",
        "2-nanogpt_failing.log",
    ]


def test_tensorboard_into_a_run_directory_needs_force(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(TB_RUN / "version_0", run_dir)
    before = sorted(p.name for p in run_dir.iterdir())
    result = run(NANOGPT, "--tensorboard", run_dir)
    assert result.exit_code == 2
    assert result.stderr == (
        f"stabilizer diagnose: error: {run_dir}: is not empty; pass --force to write into it\n"
    )
    assert sorted(p.name for p in run_dir.iterdir()) == before


def test_a_forced_export_is_never_merged_into_the_original_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(TB_RUN / "version_0", run_dir)
    original = json.loads(run(run_dir, "--json").stdout)
    # The nanoGPT log's replay (600 steps) goes into the TensorBoard run's directory (200 steps).
    assert run(NANOGPT, "--tensorboard", run_dir, "--force").exit_code == 1
    assert len(events(run_dir)) == 2
    again = json.loads(run(run_dir, "--json").stdout)
    assert again["inputs"][0]["records"] == original["inputs"][0]["records"] == 200
    assert again["findings"] == original["findings"]
    notes = [note["message"] for note in again["inputs"][0]["notes"]]
    assert "1 replay(s) by `stabilizer diagnose` not read" in notes


def test_a_forced_export_replaces_the_earlier_one(tmp_path: Path) -> None:
    tb = tmp_path / "tb"
    assert run(NANOGPT, "--tensorboard", tb).exit_code == 1
    assert run(HEALTHY, "--tensorboard", tb).exit_code == 2  # not empty any more
    assert run(HEALTHY, "--tensorboard", tb, "--force").exit_code == 0
    [replay] = events(tb)
    assert replay.name.endswith(".stabilizer-replay")
    text = EventAccumulator(str(tb))
    text.Reload()
    findings = text.Tensors("stability/findings")[0].tensor_proto.string_val[0].decode()
    assert findings == "No findings."  # the healthy log's, not the failing one's


@pytest.mark.skipif(os.name != "posix", reason="symbolic links")
def test_tensorboard_into_a_symbolic_link_is_refused_even_with_force(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / "tb"
    link.symlink_to(elsewhere)
    result = run(NANOGPT, "--tensorboard", link, "--force")
    assert result.exit_code == 2
    assert f"{link}: is a symbolic link" in result.stderr
    assert list(elsewhere.iterdir()) == []


def test_a_failed_export_leaves_no_event_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def disk_full(self: object, summary: object, step: int | None = None) -> None:
        calls.append(step)
        if len(calls) == 50:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr("stabilizer.outputs.event_file.EventWriter.add_summary", disk_full)
    result = run(NANOGPT, "--tensorboard", tmp_path / "tb")
    assert result.exit_code == 2
    assert result.stderr == (
        f"stabilizer diagnose: error: {tmp_path / 'tb'}: cannot write (No space left on device)\n"
    )
    assert events(tmp_path) == []


# --- out-of-range steps and values: a note, never a traceback ----------------------------------


def test_tensorboard_leaves_out_steps_past_int64_with_a_note(tmp_path: Path) -> None:
    result = run(HOSTILE / "steps_past_int64.jsonl", "--tensorboard", tmp_path / "tb")
    assert result.exit_code == 0, result.output
    assert (
        "note: 3 records at steps outside TensorBoard's int64 range are left out of "
        f"{tmp_path / 'tb'}"
    ) in result.stderr
    steps = [step for step, _ in scalars(tmp_path / "tb", "stability/loss")]
    assert steps == [1, 2, 3, 2**63 - 1]


def test_tensorboard_notes_values_past_float32(tmp_path: Path) -> None:
    result = run(HOSTILE / "values_past_float32.log", "--tensorboard", tmp_path / "tb")
    assert result.exit_code in (0, 1), result.output
    assert "values beyond float32's range (±3.4e38) are ±inf" in result.stderr
    losses = dict(scalars(tmp_path / "tb", "stability/loss"))
    assert losses[2] == float("inf") and losses[4] == float("-inf")


@pytest.mark.parametrize(
    ("log", "note"),
    [
        ("steps_past_int64.jsonl", None),
        ("step_past_float.jsonl", "1 plot points at steps beyond ±1e300 are left out"),
        ("values_past_float32.log", "plot points with values beyond ±1e300 are left out"),
    ],
    ids=["past-int64", "past-float", "values-past-float"],
)
def test_plot_of_out_of_range_steps_and_values(tmp_path: Path, log: str, note: str | None) -> None:
    pytest.importorskip("matplotlib")
    picture = tmp_path / "run.png"
    result = run(HOSTILE / log, "--plot", picture)
    assert result.exit_code in (0, 1), result.output
    assert picture.read_bytes().startswith(PNG)
    if note is not None:
        assert note in result.stderr
    assert all(line.startswith("stabilizer diagnose: ") for line in result.stderr.splitlines())


# --- a standard output that cannot be written: exit 2, one line ---------------------------------


def _diagnose_process(args: list[str], stdout: int) -> subprocess.CompletedProcess[str]:
    code = "from stabilizer.cli import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code, "diagnose", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize(
    "options",
    [[], ["--json"], ["--markdown"], [str(HEALTHY)], [str(HEALTHY), "--markdown"]],
    ids=["text", "json", "markdown", "two-inputs", "two-inputs-markdown"],
)
def test_a_full_stdout_is_one_line_and_exit_2(options: list[str]) -> None:
    with open("/dev/full", "w") as full:
        done = _diagnose_process([str(NANOGPT), *options], full.fileno())
    assert done.returncode == 2
    assert done.stderr == (
        "stabilizer diagnose: error: cannot write to standard output (No space left on device)\n"
    )


@pytest.mark.skipif(os.name != "posix", reason="pipes")
def test_a_closed_stdout_pipe_is_one_line_and_exit_2() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will read: writing raises EPIPE (Python ignores SIGPIPE)
    try:
        done = _diagnose_process([str(NANOGPT)], write_end)
    finally:
        os.close(write_end)
    assert done.returncode == 2
    assert (
        done.stderr == "stabilizer diagnose: error: cannot write to standard output (Broken pipe)\n"
    )
