"""``stabilizer diagnose`` through click's CliRunner: every option, exit status and bad input."""

from __future__ import annotations

import gzip
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from stabilizer import cli
from stabilizer.cli import main
from stabilizer.core.detectors import LossSpike
from stabilizer.core.records import Finding, Severity, StepRecord
from stabilizer.replay.readers import READERS, LogReadError
from stabilizer.report import inputs, session

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "logs"
EXAMPLES = ROOT / "examples" / "logs"
MEGATRON = FIXTURES / "megatron_failing.log"  # fp16 overflow (error) + NaN for good (critical)
NANOGPT = FIXTURES / "nanogpt_failing.log"  # one loss spike (warning)
HEALTHY = FIXTURES / "nanogpt_healthy.log"
TB_RUN = FIXTURES / "tensorboard_failing"  # per-layer norms, depth imbalance (warning)


def run(*args: str | Path, input: bytes | None = None) -> Result:
    result = CliRunner().invoke(main, ["diagnose", *map(str, args)], input=input)
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result


def event_file(directory: Path) -> Path:
    return next(directory.rglob("events.out.tfevents.*"))


# --- exit statuses and --fail-on ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("log", "fail_on", "status"),
    [
        (HEALTHY, "info", 0),
        (NANOGPT, "info", 1),
        (NANOGPT, "warning", 1),
        (NANOGPT, "error", 0),
        (MEGATRON, "error", 1),
        (MEGATRON, "critical", 1),
        (TB_RUN, "critical", 0),
    ],
    ids=[
        "healthy",
        "spike-info",
        "spike-warning",
        "spike-error",
        "nan-error",
        "nan-critical",
        "tb",
    ],
)
def test_exit_status_follows_fail_on(log: Path, fail_on: str, status: int) -> None:
    result = run(log, "--fail-on", fail_on)
    assert result.exit_code == status, result.output


def test_text_report_of_a_failing_megatron_log() -> None:
    result = run(MEGATRON)
    assert result.exit_code == 1
    out = result.stdout
    assert out.startswith(
        f"diagnosis of {MEGATRON}\nformat    megatron\nrecords   200, steps 10–2000"
    )
    assert "Megatron losses are averages over the log interval" in out
    assert "CRITICAL  non-finite loss (NaN/Inf)" in out
    assert "never recovers: the loss is non-finite from step 1510" in out
    assert "run softmax and LayerNorm in fp32" in out
    assert out.rstrip().splitlines()[-1].startswith("verdict: critical:")
    assert result.stderr == ""


def test_healthy_log_exits_0_with_a_healthy_verdict() -> None:
    result = run(HEALTHY)
    assert result.exit_code == 0
    assert "verdict: healthy: no instabilities found in 600 records" in result.stdout


# --- inputs: stdin, gzip, directories, several paths, --format ---------------------------------


def test_stdin() -> None:
    result = run("-", input=NANOGPT.read_bytes())
    assert result.exit_code == 1
    assert result.stdout.startswith("diagnosis of standard input\nformat    generic")
    assert "WARNING  loss spike" in result.stdout


def test_gzip_file_and_gzip_stdin(tmp_path: Path) -> None:
    packed = tmp_path / "train.log.gz"
    packed.write_bytes(gzip.compress(MEGATRON.read_bytes()))
    for args, data in (((packed,), None), (("-",), packed.read_bytes())):
        result = run(*args, "--json", input=data)
        assert result.exit_code == 1
        report = json.loads(result.stdout)
        assert report["inputs"][0]["format"] == "megatron"
        assert report["inputs"][0]["records"] == 200


def test_run_directory() -> None:
    result = run(TB_RUN)
    assert result.exit_code == 1
    assert "format    tensorboard" in result.stdout
    assert "starved layers (depth imbalance)" in result.stdout
    assert "where     block_00, block_01, block_02" in result.stdout


def test_several_paths_are_diagnosed_one_by_one_and_the_worst_status_wins() -> None:
    result = run(HEALTHY, NANOGPT, "--fail-on", "warning")
    assert result.exit_code == 1
    assert result.stdout.count("diagnosis of ") == 2
    assert "verdict: healthy" in result.stdout and "verdict: warning" in result.stdout
    assert result.stdout.rstrip().endswith(
        "overall: 2 inputs, worst finding: warning; exit status 1"
    )


def test_a_head_that_misleads_is_read_by_the_universal_reader(tmp_path: Path) -> None:
    """An HF Trainer's banner above a script's own tqdm lines (trace#5) made the log an
    ``hf_trainer`` one, whose reader found no step: exit 2. Under ``auto`` the universal reader
    reads it then, and a note says so; a log no reader reads still fails with the first error."""
    bar = "Epoch 1, Step {s}, Loss: {loss}:   1%|▏         | {n}/144 [00:02<02:20,  1.01it/s]"
    lines = [bar.format(s=s, loss=1.0 + 0.1 * (s % 3), n=s + 2) for s in range(8)]
    log = tmp_path / "trace.log"
    log.write_text("***** Running training *****\n\n" + "\n".join(lines) + "\n")
    result = run(log, "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)["inputs"][0]
    assert report["format"] == "generic" and report["records"] == 8
    assert any("looked like a hf_trainer log" in note["message"] for note in report["notes"])
    unread = tmp_path / "unread.log"
    unread.write_text("***** Running training *****\n  Num examples = 10\nSaving the model\n")
    failed = run(unread)
    assert failed.exit_code == 2
    assert "no training steps found in this hf_trainer log" in failed.stderr


def test_format_override() -> None:
    result = run(NANOGPT, "--format", "generic", "--json")
    assert json.loads(result.stdout)["inputs"][0]["format"] == "generic"
    mismatch = run(NANOGPT, "--format", "megatron")
    assert mismatch.exit_code == 2
    assert mismatch.stderr == (
        f"stabilizer diagnose: error: {NANOGPT}: no training steps found in this megatron log; "
        "line 6 looked like one but was not read: 'step 0: train loss 10.6237, val loss 10.9457'"
        "; if it is another format, name that with --format (or auto)\n"
    )


@pytest.mark.parametrize("old", ["nanogpt", "modded_nanogpt"])
def test_the_old_names_of_console_formats_read_as_generic(old: str) -> None:
    result = run(NANOGPT, "--format", old, "--json")
    assert result.exit_code == 1
    assert json.loads(result.stdout)["inputs"][0]["format"] == "generic"


def test_an_unreadable_text_log_says_what_was_looked_for(tmp_path: Path) -> None:
    path = tmp_path / "train.log"
    path.write_text("Loading model\nepoch 1 done, the loss went down nicely\nbye\n")
    result = run(path)
    assert result.exit_code == 2
    assert result.stderr == (
        f"stabilizer diagnose: error: {path}: no training steps found; looked for lines with a "
        "step (step, iter, iteration, global_step, num_updates, update, batch, Epoch n/N, [n/N]) "
        "and metrics beside it (loss, grad_norm, lr, loss_scale or an alias); line 2 looked like "
        "one but was not read: 'epoch 1 done, the loss went down nicely'; if the log has a format "
        "of its own, name it with --format\n"
    )


def test_format_choices_are_the_registered_readers() -> None:
    result = run(NANOGPT, "--format", "bogus")
    assert result.exit_code == 2
    assert all(name in result.output for name in READERS)


# --- output forms ------------------------------------------------------------------------------


def test_json_report() -> None:
    result = run(MEGATRON, HEALTHY, "--json", "--fail-on", "critical")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert set(report) == {"inputs", "findings", "summary"}
    first, second = report["inputs"]
    assert first["path"] == str(MEGATRON) and first["format"] == "megatron"
    assert first["steps"] == {"first": 10, "last": 2000} and len(first["segments"]) == 1
    assert any("averages over the log interval" in n["message"] for n in first["notes"])
    assert first["summary"]["worst"] == "critical" and first["summary"]["exit_code"] == 1
    assert second["summary"]["exit_code"] == 0 and second["summary"]["findings"] == 0
    kinds = {(f["kind"], f["severity"], f["input"], f["segment"]) for f in report["findings"]}
    assert ("nonfinite_loss", "critical", 0, 1) in kinds
    assert ("fp16_overflow", "error", 0, 1) in kinds
    # The persisting NaN is one episode: its closing finding ("until the end of the log")
    # updates the entry of the first, it is no second finding (#21).
    assert report["summary"]["counts"]["critical"] == 1
    [nan] = [f for f in report["findings"] if f["kind"] == "nonfinite_loss"]
    assert "until the end of the log" in nan["message"]
    assert report["summary"]["exit_code"] == 1 and report["summary"]["fail_on"] == "critical"


def test_markdown_report() -> None:
    result = run(TB_RUN, "--markdown")
    assert result.exit_code == 1
    assert result.stdout.startswith(f"## Diagnosis of `{TB_RUN}`")
    assert "#### #1 · steps" in result.stdout and "**Verdict:** warning" in result.stdout


def test_json_and_markdown_exclude_each_other() -> None:
    result = run(NANOGPT, "--json", "--markdown")
    assert result.exit_code == 2
    assert "--json and --markdown exclude each other" in result.output


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    picture = tmp_path / "run.png"
    result = run(TB_RUN, "--plot", picture)
    assert result.exit_code == 1
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot of {TB_RUN}: {picture}" in result.stderr


def test_outputs_of_several_inputs_are_numbered() -> None:
    assert session.plot_path(Path("run.png"), 1, 1) == Path("run.png")
    assert session.plot_path(Path("out/run.png"), 2, 3) == Path("out/run-2.png")
    assert session.plot_path(Path("noext"), 2, 3) == Path("noext-2")
    assert session.run_dir(Path("tb"), 1, 2, "x/train.log.gz") == Path("tb/1-train.log")
    assert session.run_dir(Path("tb.d"), 2, 2, "-") == Path("tb.d/2-stdin")
    assert session.plot_path(None, 2, 2) is None


def test_plot_without_matplotlib_is_one_line_and_exit_2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    result = run(NANOGPT, "--plot", "out.png")
    assert result.exit_code == 2
    assert result.stderr == (
        "stabilizer diagnose: error: `--plot` needs matplotlib: "
        "pip install 'stabilizer-lightning[plot]'\n"
    )


def test_tensorboard_export_reads_back_in_tensorboard(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = run(MEGATRON, "--tensorboard", tmp_path / "tb")
    assert result.exit_code == 1
    accumulator = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    accumulator.Reload()
    tags = accumulator.Tags()
    assert {"stability/loss", "stability/grad_norm", "stability/loss_scale"} <= set(tags["scalars"])
    assert len(accumulator.Scalars("stability/loss")) == 200
    text = accumulator.Tensors("stability/findings")[0].tensor_proto.string_val[0].decode()
    assert " nonfinite_loss**" in text and " fp16_overflow**" in text
    assert "custom_scalars__config__" in tags["tensors"]


def test_tensorboard_export_has_the_heatmap_and_one_run_per_input(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = run(TB_RUN, NANOGPT, "--tensorboard", tmp_path)
    assert result.exit_code == 1
    first = EventAccumulator(str(event_file(tmp_path / "1-tensorboard_failing")))
    first.Reload()
    assert "stability/grad_norm_heatmap" in first.Tags()["images"]
    assert "stability/grad_norm/block_00" in first.Tags()["scalars"]
    assert event_file(tmp_path / "2-nanogpt_failing.log")


def test_plot_into_a_missing_folder(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = run(NANOGPT, "--plot", tmp_path / "nowhere" / "run.png")
    assert result.exit_code == 2
    assert result.stderr == (
        f"stabilizer diagnose: error: {tmp_path / 'nowhere'}: the --plot folder does not exist "
        "or is not writable\n"
    )


def test_tensorboard_directory_that_cannot_be_made(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = run(NANOGPT, "--tensorboard", blocker / "tb")
    assert result.exit_code == 2
    assert result.stderr.startswith("stabilizer diagnose: error: ")
    assert "cannot create the TensorBoard directory" in result.stderr


def test_progress_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inputs, "PROGRESS_DELAY", 0.0)
    monkeypatch.setattr(cli, "_stderr_is_terminal", lambda: True)
    result = run(NANOGPT)
    assert result.exit_code == 1
    assert f"reading {NANOGPT}" in result.stderr
    assert result.stdout.startswith(f"diagnosis of {NANOGPT}")


def test_a_long_read_shows_its_progress_whatever_the_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """#41: a log of a million lines (tens of MB, below the 50 MiB the bar waited for) was read
    for 15 s without a word. The bar shows once the reading has lasted `PROGRESS_DELAY`; a quick
    read shows none; stdin is named as such."""
    log = tmp_path / "long.log"
    lines = [f"step {i} loss {2.5 - i * 1e-6:.6f}" for i in range(1, 40_001)]
    log.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(cli, "_stderr_is_terminal", lambda: True)
    assert "reading" not in run(NANOGPT).stderr  # a quick read: no bar
    clock = iter(range(0, 10**6, 5))  # every look at the clock: 5 s later
    monkeypatch.setattr(inputs, "_clock", lambda: float(next(clock)))
    assert f"reading {log}" in run(log).stderr
    assert "reading standard input" in run("-", input=log.read_bytes()).stderr


# --- bad input: one line on stderr, exit 2 -----------------------------------------------------


def _binary(path: Path) -> Path:
    path.write_bytes(bytes(range(256)) * 64)
    return path


def _unknown(path: Path) -> Path:
    path.write_text("hello\nthis is not a training log\njust some words\n")
    return path


def _empty(path: Path) -> Path:
    path.write_bytes(b"")
    return path


def _empty_directory(path: Path) -> Path:
    path.mkdir()
    (path / "notes.txt").write_text("nothing to see")
    return path


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (_empty, "empty file"),
        (_binary, "binary data"),
        (_unknown, "no training steps found; looked for lines with a step"),
        (_empty_directory, "nothing readable in this directory"),
        (lambda path: path, "no such file or directory"),
    ],
    ids=["empty", "binary", "unknown-format", "directory-nothing-readable", "missing"],
)
def test_unreadable_input_is_one_line_and_exit_2(
    make: Callable[[Path], Path], message: str, tmp_path: Path
) -> None:
    path = make(tmp_path / "input")
    result = run(path)
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"stabilizer diagnose: error: {path}: ")
    assert message in result.stderr


def test_empty_stdin() -> None:
    """#41: empty standard input was called ``-`` (``-: empty file``)."""
    result = run("-", input=b"")
    assert result.exit_code == 2
    want = "stabilizer diagnose: error: standard input: empty (nothing was written to it)\n"
    assert result.stderr == want


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads anything")
def test_permission_denied(tmp_path: Path) -> None:
    locked = tmp_path / "locked.log"
    shutil.copy(NANOGPT, locked)
    locked.chmod(0)
    result = run(locked)
    assert result.exit_code == 2
    assert "permission denied" in result.stderr


def test_one_unreadable_input_among_several(tmp_path: Path) -> None:
    result = run(HEALTHY, tmp_path / "missing.log", "--json")
    assert result.exit_code == 2
    report = json.loads(result.stdout)
    assert report["inputs"][1] == {
        "path": str(tmp_path / "missing.log"),
        "error": f"{tmp_path / 'missing.log'}: no such file or directory",
        "summary": {"exit_code": 2},
    }
    assert report["summary"]["unreadable"] == 1


def test_stdin_given_twice_is_a_usage_error() -> None:
    result = run("-", "-", input=b"")
    assert result.exit_code == 2
    assert "can be given only once" in result.output


def test_truncated_event_file_reports_what_was_read(tmp_path: Path) -> None:
    data = event_file(TB_RUN).read_bytes()
    cut = tmp_path / "events.out.tfevents.1714550400.cut"
    cut.write_bytes(data[: len(data) // 2 + 3])
    result = run(cut, "--fail-on", "info")
    assert result.exit_code == 0
    assert "format    tensorboard" in result.stdout
    assert "truncated record at byte" in result.stdout
    assert "the log is cut short: read up to the damage" in result.stdout


def test_over_long_line_is_skipped_with_a_note(tmp_path: Path) -> None:
    lines = NANOGPT.read_bytes().splitlines(keepends=True)
    log = tmp_path / "long.log"
    log.write_bytes(b"".join(lines[:100]) + b"x" * (3 << 20) + b"\n" + b"".join(lines[100:]))
    result = run(log)
    assert result.exit_code == 1
    assert "over-long line" in result.stdout and "WARNING  loss spike" in result.stdout


# --- the example logs and the import budget ----------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("megatron_gpt345m.log", ["segments  2", "loss spike", "CRITICAL  non-finite loss"]),
        ("nanogpt_shakespeare_char.log", ["ERROR  loss divergence"]),
        ("lightning_post_ln", ["starved layers (depth imbalance)", "blocks 0-5"]),
    ],
    ids=["megatron", "nanogpt", "lightning"],
)
def test_shipped_example_logs(name: str, expected: list[str]) -> None:
    result = run(EXAMPLES / name)
    assert result.exit_code == 1
    for text in expected:
        assert text in result.stdout


def test_diagnose_imports_neither_torch_nor_lightning(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from stabilizer.cli import main\n"
        f"args = ['diagnose', {str(TB_RUN)!r}, '--json', '--tensorboard', {str(tmp_path)!r}]\n"
        "result = CliRunner().invoke(main, args)\n"
        "assert result.exit_code == 1, result.output\n"
        "print(sorted(m for m in sys.modules\n"
        "             if m.split('.')[0] in ('torch', 'lightning', 'pytorch_lightning')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_any_read_error_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(path: str, format: str, **kwargs: object) -> None:
        raise LogReadError(f"{path}: permission denied")

    monkeypatch.setattr(session, "diagnose", refuse)
    result = run(NANOGPT)
    assert result.exit_code == 2
    assert result.stderr == f"stabilizer diagnose: error: {NANOGPT}: permission denied\n"


def test_a_detector_that_raises_is_a_warning_line_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(self: LossSpike, record: StepRecord) -> list[Finding]:
        raise RuntimeError("boom")

    monkeypatch.setattr(LossSpike, "update", broken)
    result = run(NANOGPT, "--fail-on", "error")
    assert result.exit_code == 0
    assert (
        "stabilizer diagnose: warning: detector 'loss_spike' raised; it is disabled for the rest "
        "of the run\n"
    ) in result.stderr


def test_live_only_findings_reach_the_report(tmp_path: Path) -> None:
    # A real protected run with a NaN: its log holds the root cause and the preflight note,
    # which no replay of the numbers can derive; the post-mortem must show them.
    from test_protect import Fault, tiny, train

    from stabilizer.callbacks.monitor import StabilityMonitor

    log = tmp_path / "stability.jsonl"
    train(tiny("32-true"), StabilityMonitor(jsonl=log), Fault("activation"))
    result = run(log, "--json")
    kinds = {f["kind"]: f for f in json.loads(result.output)["findings"]}
    assert {"nonfinite_loss", "root_cause", "config_risk"} <= set(kinds)
    assert kinds["root_cause"]["location"] == ["blocks.1.mlp"]
    text = run(log).output
    # the root cause is evidence of the NaN's episode, not an episode of its own
    assert "blocks.1.mlp" in text and "non-finite loss (NaN/Inf)" in text
    assert "produced NaN/Inf in the forward pass" in text


def _jsonl(path: Path, nan_at: int | None = None) -> None:
    path.parent.mkdir(parents=True)
    values = [{"loss": math.nan if step == nan_at else 2.0} for step in range(30)]
    path.write_text("".join(StepRecord(s, v).to_json() + "\n" for s, v in enumerate(values)))


def test_a_nan_that_persists_in_a_monitors_log_is_one_entry(tmp_path: Path) -> None:
    """#34: a NaN's first finding names every depth group, its "persists" none; the episode key
    held the location, so the JSON report listed the NaN twice. One episode rule now
    (`stabilizer.core.episode`): one entry, at its worst, naming the groups."""
    groups = ("embed", "block_00", "head")
    lines = []
    for step in range(40):
        nan = step >= 20
        values = {"loss": math.nan if nan else 2.0, "grad_norm": math.nan if nan else 1.0}
        values.update({f"grad_norm/{group}": math.nan if nan else 0.5 for group in groups})
        lines.append(StepRecord(step, values).to_json() + "\n")
    log = tmp_path / "stability.jsonl"
    log.write_text("".join(lines))
    [nan] = json.loads(run(log, "--json").output)["findings"]
    assert (nan["kind"], nan["step"], nan["end_step"]) == ("nonfinite_loss", 20, 39)
    assert nan["severity"] == "critical" and nan["location"] == list(groups)


def test_a_directory_of_runs_is_each_run_then_one_overall_line(tmp_path: Path) -> None:
    """#21: ``stabilizer diagnose runs`` read only the newest of the runs in it."""
    for name, nan_at in (
        ("healthy/version_0", None),
        ("nan/version_0", 10),
        ("nan/version_1", None),
    ):
        _jsonl(tmp_path / "runs" / name / "stability.jsonl", nan_at)
    result = run(tmp_path / "runs")
    assert result.exit_code == 1, result.output
    heads = [line for line in result.stdout.splitlines() if line.startswith("diagnosis of ")]
    assert heads == [
        f"diagnosis of {tmp_path / 'runs' / name}"
        for name in ("healthy/version_0", "nan/version_0", "nan/version_1")
    ]
    assert result.stdout.rstrip().splitlines()[-1] == (
        "overall: 3 inputs, worst finding: error; exit status 1"
    )
    one = run(tmp_path / "runs" / "healthy")  # a directory of one run is that run
    assert one.exit_code == 0 and "overall" not in one.stdout


def test_a_readme_is_no_training_log() -> None:
    """#21/#22: `stabilizer diagnose README.md` reported a CRITICAL episode and exited 1."""
    result = run(Path(__file__).resolve().parents[1] / "README.md")
    assert result.exit_code == 2
    assert "no training" in result.stderr and "episode" not in result.stdout


def _restarted_log(path: Path, with_finding: bool) -> Path:
    """A stability.jsonl: 100 steps at a 3.3 plateau, auto's restart from the step-0 snapshot as
    pre-LN (its remedy_applied finding), then the initial weights' loss at 5.5 for 41 steps (held
    there: a loss learnt down from a jump is a new level anyway, #39)."""
    lines = [{"type": "run", "policy": "auto", "groups": []}]
    losses = [3.3 + 0.02 * math.sin(i) for i in range(100)]
    losses += [5.5 + 0.02 * math.sin(i) for i in range(41)]
    for step, loss in enumerate(losses):
        lines.append({"type": "step", "step": step, "values": {"loss": loss, "grad_norm": 1.0}})
        if step == 99 and with_finding:
            swap = Finding(
                "remedy_applied", 99, 99, Severity.INFO, "swap_to_pre_ln after depth_imbalance",
                {"blocks": 12.0, "restored_step": 0.0}, remedies=("swap_to_pre_ln",),
            )  # fmt: skip
            lines.append({"type": "finding", **swap.to_dict()})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_a_replay_starts_its_baselines_over_where_the_monitor_restarted(tmp_path: Path) -> None:
    from stabilizer.replay.diagnose import diagnose

    kinds = {
        i.finding.kind for i in diagnose(str(_restarted_log(tmp_path / "a.jsonl", False))).findings
    }
    assert "divergence" in kinds  # the loss of the initial weights against the plateau's
    found = diagnose(str(_restarted_log(tmp_path / "b.jsonl", True))).findings
    assert [i.finding.kind for i in found] == ["remedy_applied"]
