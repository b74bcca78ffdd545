"""`stabilizer watch` on logs that grow while it runs: a real writer process, the real CLI.

A subprocess writes a DeepSpeed console log line by line (healthy steps, a NaN loss, an fp16
overflow cascade); the log is rotated (renamed, a new file) and truncated under the watcher. Each
phase waits for the watcher's line about it, never for a time: these tests say nothing of speed
(``benchmarks/watch.py`` measures latency and idle CPU).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from readers.paste_shapes import shaped

from stabilizer.cli import main
from stabilizer.core.records import StepRecord
from stabilizer.replay.watch import Alert, Watch

_WRITER = """
import sys, time
path, mode = sys.argv[1], sys.argv[2]
with open(path, mode) as log:
    for line in sys.stdin:
        log.write(line)
        log.flush()
        time.sleep(0.002)
"""
_WATCH = [sys.executable, "-c", "from stabilizer.cli import main; main()", "watch"]
_WAIT = 60.0  # seconds a phase may take on a loaded machine before the test fails


def _healthy(first: int, last: int) -> list[str]:
    return [f"steps: {i} loss: {2.5 - i * 0.001:.4f} lr: [0.0001]" for i in range(first, last + 1)]


def _cascade(step: int, scales: int) -> list[str]:
    lines = []
    for i in range(scales):
        scale = 65536 >> i
        lines.append(
            f"[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: {scale}, "
            f"reducing to {scale // 2}"
        )
    return lines + _healthy(step, step + 2)


def _write(path: Path, lines: list[str], mode: str = "a") -> None:
    """Append (or write) ``lines`` from a subprocess, one line at a time."""
    text = "".join(line + "\n" for line in lines)
    subprocess.run(
        [sys.executable, "-c", _WRITER, str(path), mode], input=text, text=True, check=True
    )


class _Watcher:
    """The CLI in a subprocess; its output lines collected by threads."""

    def __init__(self, *args: str, stdin: int | None = None) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [*_WATCH, *args],
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            preexec_fn=_ctrl_c_heard,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=_collect, args=(stream, lines), daemon=True).start()

    def wait_for(self, text: str, where: str = "out", count: int = 1) -> None:
        lines = self.out if where == "out" else self.err
        deadline = time.monotonic() + _WAIT
        while sum(text in line for line in list(lines)) < count:
            assert self.proc.poll() is None, f"watch ended early: {self.out} {self.err}"
            assert time.monotonic() < deadline, f"no {text!r} in {lines}"
            time.sleep(0.05)

    def interrupt(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(_WAIT)


def _ctrl_c_heard() -> None:
    """In the child, before exec: SIGINT back to its default, so that Python turns it into
    KeyboardInterrupt as at a terminal. A suite started in the background by a shell (``cmd &``)
    inherits SIGINT ignored, and the watch would never hear `interrupt`."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _collect(stream: object, lines: list[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        lines.append(line.rstrip("\n"))


def test_watch_follows_nan_overflow_rotation_truncation(
    tmp_path: Path, watcher: list[_Watcher]
) -> None:
    log = tmp_path / "train.log"
    _write(log, _healthy(1, 40), "w")  # history: read silently, the detectors' baseline
    w = _Watcher(str(log))
    watcher.append(w)
    w.wait_for("following", "err")
    _write(log, [*_healthy(41, 60), "steps: 61 loss: nan lr: [0.0001]", *_healthy(62, 70)])
    w.wait_for("step 61 error nonfinite_loss")
    _write(log, _cascade(71, 17))
    w.wait_for("fp16_overflow")
    log.rename(tmp_path / "train.log.1")  # rotation: the job restarts into a new file
    nan = "loss: nan lr: [0.0001]"
    _write(log, [f"steps: 1 {nan}", *_healthy(2, 29), f"steps: 30 {nan}"], "w")
    w.wait_for("rotated", "err")
    w.wait_for("step 1 error nonfinite_loss")
    w.wait_for("step 30 error nonfinite_loss")  # read to its end: shorter content is a truncation
    _write(log, _healthy(1, 5), "w")  # truncated: written again from its start
    w.wait_for("truncated", "err")
    status = w.interrupt()
    text = "\n".join(w.out)
    assert status == 1, text  # diagnose's status: errors found
    assert "steps 1–40" not in text.split("diagnosis of")[0]  # no history finding printed
    assert "diagnosis of" in text and "a new run" in text  # (from step 1 again: no resume)
    assert not any("Traceback" in line for line in w.err), w.err


def test_watch_starts_before_the_file_and_reads_history_with_from_start(
    tmp_path: Path, watcher: list[_Watcher]
) -> None:
    log = tmp_path / "late.log"
    w = _Watcher(str(log), "--from-start", "--exit-on", "error")
    watcher.append(w)
    w.wait_for("not there yet", "err")
    _write(log, [*_healthy(1, 30), "steps: 31 loss: nan lr: [0.0001]"], "w")
    assert w.proc.wait(_WAIT) == 1  # --exit-on error: stops at the NaN
    assert any("step 31 error nonfinite_loss" in line for line in w.out), w.out
    assert any("--exit-on" in line for line in w.err), w.err


def test_watch_of_a_pipe_ends_with_the_pipe_and_agrees_with_diagnose(tmp_path: Path) -> None:
    lines = [*_healthy(1, 40), "steps: 41 loss: nan lr: [0.0001]", *_healthy(42, 50)]
    log = tmp_path / "piped.log"
    log.write_text("".join(line + "\n" for line in lines))
    with log.open("rb") as stdin:
        done = subprocess.run([*_WATCH, "-"], stdin=stdin, capture_output=True, text=True)
    diagnosed = CliRunner().invoke(main, ["diagnose", str(log)])
    assert done.returncode == diagnosed.exit_code == 1, done.stderr
    found = [
        line.split(" ", 1)[1] for line in done.stdout.splitlines() if " nonfinite_loss" in line
    ]
    assert found and found[0].startswith("step 41 error nonfinite_loss")
    assert diagnosed.output.split("\n", 1)[1] in done.stdout.replace("standard input", str(log))


@pytest.mark.parametrize(
    ("log", "shape"),
    [
        ("megatron_bert_nccl743_startup_skips", "fenced"),
        ("hf_deepspeed_t5_issue9996_startup_probing", "logging_prefix"),
    ],
)
def test_watch_reads_a_pasted_log_as_diagnose_does(tmp_path: Path, log: str, shape: str) -> None:
    """#34: format detection was written twice, and watch's did not take a paste's wrapper (a
    fence, a logger's prefix) off the lines: on 15 of 30 pasted real logs its findings were not
    diagnose's. Both call `detect_head` now."""
    real = Path(__file__).parent / "fixtures" / "real" / "logs" / f"{log}.log"
    pasted = tmp_path / "pasted.log"
    pasted.write_text(shaped(real.read_text(), shape))
    with pasted.open("rb") as stdin:
        done = subprocess.run([*_WATCH, "-"], stdin=stdin, capture_output=True, text=True)
    diagnosed = CliRunner().invoke(main, ["diagnose", str(pasted)])
    assert diagnosed.output.split("\n", 1)[1] in done.stdout.replace("standard input", str(pasted))


def test_watch_usage_errors() -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["watch", "-", "-"])
    assert result.exit_code == 2 and "only once" in result.output
    result = runner.invoke(main, ["watch", "x.log", "--webhook", "ftp://host/secret-token"])
    assert result.exit_code == 2 and "http or https" in result.output
    assert "secret-token" not in result.output


def test_watch_help_documents_every_option() -> None:
    command = main.commands["watch"]  # type: ignore[attr-defined]
    options = [p for p in command.params if p.param_type_name == "option"]
    assert {o.name for o in options} >= {"from_start", "exit_on", "command", "webhook"}
    assert all(o.help for o in options), [o.name for o in options if not o.help]
    out = CliRunner().invoke(main, ["watch", "--help"]).output
    for flag in ("--from-start", "--exit-on", "--exec", "--webhook", "--notify-on", "--format"):
        assert flag in out
    assert "Exit status" in out


def _watch_in_thread(
    paths: list[str], tell: list[str]
) -> tuple[Watch, list[Alert], threading.Thread]:
    alerts: list[Alert] = []
    watch = Watch(paths, alerts.append, tell=tell.append)
    thread = threading.Thread(target=watch.run, daemon=True)
    thread.start()
    return watch, alerts, thread


def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + _WAIT
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_partial_last_line_waits_for_its_end(tmp_path: Path) -> None:
    log = tmp_path / "partial.log"
    log.write_text("".join(line + "\n" for line in _healthy(1, 30)) + "steps: 31 loss: n")
    told: list[str] = []
    watch, alerts, thread = _watch_in_thread([str(log)], told)
    _until(lambda: any("following" in line for line in told))
    time.sleep(0.3)  # (polled a few times while the line was cut: "n" is no value)
    with log.open("a") as out:
        out.write("an lr: [0.0001]\n")
    _until(lambda: bool(alerts))
    watch.stop()
    thread.join(_WAIT)
    assert [(a.finding.kind, a.finding.step, a.live) for a in alerts] == [
        ("nonfinite_loss", 31, True)
    ]


def test_a_run_directory_whose_log_appears_later(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    told: list[str] = []
    watch, alerts, thread = _watch_in_thread([str(run)], told)
    version = run / "version_0"
    version.mkdir()
    records = [StepRecord(i, {"loss": 2.5, "grad_norm": 0.5}) for i in range(1, 30)]
    records.append(StepRecord(30, {"loss": math.nan, "grad_norm": math.nan}))
    (version / "stability.jsonl").write_text("".join(r.to_json() + "\n" for r in records))
    _until(lambda: bool(alerts))
    watch.stop()
    thread.join(_WAIT)
    assert alerts[0].finding.kind == "nonfinite_loss" and alerts[0].finding.step == 30
    assert any("stability.jsonl" in line for line in told), told


def test_binary_input_and_a_dead_webhook_cost_one_line_each(tmp_path: Path) -> None:
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 64)
    done = subprocess.run([*_WATCH, str(binary)], capture_output=True, text=True, timeout=_WAIT)
    assert done.returncode == 2 and "binary data" in done.stderr
    assert "Traceback" not in done.stderr
    log = tmp_path / "nan.log"
    log.write_text("".join(line + "\n" for line in [*_healthy(1, 30), "steps: 31 loss: nan"]))
    url = "http://127.0.0.1:9/services/T0/B0/secret-token"  # port 9 (discard): nothing listens
    with log.open("rb") as stdin:
        done = subprocess.run(
            [*_WATCH, "-", "--webhook", url], stdin=stdin, capture_output=True, text=True
        )
    assert done.returncode == 1, done.stderr
    warned = [line for line in done.stderr.splitlines() if "failed" in line]
    assert len(warned) == 1 and "127.0.0.1" in warned[0], done.stderr
    assert "secret-token" not in done.stderr + done.stdout


def test_several_logs_at_once_and_a_restart_in_one(tmp_path: Path) -> None:
    first, second = tmp_path / "rank0.log", tmp_path / "rank1.log"
    first.write_text("".join(line + "\n" for line in _healthy(1, 30)))
    second.write_text("".join(line + "\n" for line in _healthy(1, 30)))
    told: list[str] = []
    watch, alerts, thread = _watch_in_thread([str(first), str(second)], told)
    _until(lambda: sum("following" in line for line in told) == 2)
    _write(first, ["steps: 31 loss: nan lr: [0.0001]"])
    _write(second, [*_healthy(10, 20), "steps: 21 loss: nan lr: [0.0001]"])  # resumed at 10
    _until(lambda: len(alerts) >= 2)
    watch.stop()
    thread.join(_WAIT)
    seen = {(Path(a.path).name, a.segment, a.finding.kind, a.finding.step) for a in alerts}
    assert ("rank0.log", 1, "nonfinite_loss", 31) in seen
    assert ("rank1.log", 2, "nonfinite_loss", 21) in seen


def test_watch_gives_back_the_callers_sigterm_handler_however_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`watch` takes SIGTERM as Ctrl-C while it runs; a run that raises (here the session's
    `run`, a collaborator, made to fail) still puts the caller's handler back."""
    import stabilizer.report.watching as watching

    def fail(self: object) -> None:
        raise RuntimeError("the session failed")

    monkeypatch.setattr(watching.WatchSession, "run", fail)
    log = tmp_path / "train.log"
    log.write_text("iter 1: loss 2.0\n")
    before = signal.getsignal(signal.SIGTERM)
    result = CliRunner().invoke(main, ["watch", str(log)])
    assert isinstance(result.exception, RuntimeError)
    assert signal.getsignal(signal.SIGTERM) is before
