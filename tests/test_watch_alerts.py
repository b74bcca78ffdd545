"""`stabilizer watch` alerts on an episode's updates too, and follows paths that appear later.

#33: a NaN that persists is an error, then (the same episode, updated) critical; `watch` alerted
on new episodes only, so ``--exit-on critical`` never exited and ``--notify-on critical`` sent
nothing. A run directory that did not exist yet was opened as a file ("cannot read (Is a
directory)" ten times a second) and never followed. Real CLI processes, a real writer appending
line by line, a real HTTP server for the webhook (as tests/test_notify.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from test_notify import _Hook
from test_watch import _WAIT, _healthy, _Watcher, _write

from stabilizer.core.records import StepRecord

_NAN = "steps: {} loss: nan lr: [0.0001]"


def test_a_persistent_nan_escalates_to_critical_stops_and_is_sent(
    tmp_path: Path, watcher: list[_Watcher], hook: _Hook
) -> None:
    log = tmp_path / "train.log"
    _write(log, _healthy(1, 40), "w")  # the history: the detectors' baseline
    options = ["--exit-on", "critical", "--notify-on", "critical", "--webhook", hook.url]
    w = _Watcher(str(log), *options)
    watcher.append(w)
    w.wait_for("following", "err")
    _write(log, [_NAN.format(step) for step in range(41, 47)])  # line by line
    assert w.proc.wait(_WAIT) == 1, (w.out, w.err)  # stopped at the critical update
    printed = [line.split(" ", 1)[1] for line in w.out if " nonfinite_loss" in line]
    assert printed[0].startswith("step 41 error nonfinite_loss: loss is nan at step 41")
    assert printed[1].startswith(
        "steps 41-45 critical nonfinite_loss: NaN/Inf loss persists for 5 steps since step 41"
    )
    assert any("stopped at" in line and "critical nonfinite_loss" in line for line in w.err)
    alerts = "\n".join(w.out).split("diagnosis of")[0]
    assert "until the end of the log" not in alerts  # stopped, not ended
    # The webhook: the episode once, when it reached critical (the error was below the level).
    sent = [post["stabilizer"] for post in hook.posts]
    assert [(s["event"], s["finding"]["severity"], s["finding"]["step"]) for s in sent] == [
        ("open", "critical", 41)
    ], sent


def test_the_recovery_of_a_sent_episode_is_sent_with_notify_close(
    tmp_path: Path, hook: _Hook
) -> None:
    lines = [*_healthy(1, 40), *(_NAN.format(step) for step in range(41, 48)), *_healthy(48, 60)]
    log = tmp_path / "piped.log"
    log.write_text("".join(line + "\n" for line in lines))
    options = ["--notify-on", "critical", "--notify-close", "--webhook", hook.url]
    with log.open("rb") as stdin:  # a pipe: its end is the log's
        done = _run_watch(["-", *options], stdin)
    assert done.returncode == 1, done.stderr
    assert "steps 41-47 info nonfinite_loss: loss finite again at step 48" in done.stdout
    sent = [post["stabilizer"] for post in hook.posts]
    events = [(one["event"], one["finding"]["severity"]) for one in sent]
    assert events == [("open", "critical"), ("close", "info")], hook.posts
    assert "closed: steps 41-47 info nonfinite_loss" in hook.posts[1]["text"]


def _run_watch(args: list[str], stdin: object) -> object:
    import subprocess
    import sys

    command = [sys.executable, "-c", "from stabilizer.cli import main; main()", "watch", *args]
    return subprocess.run(command, stdin=stdin, capture_output=True, text=True, timeout=_WAIT)


def test_a_run_directory_created_after_the_watch_began_is_followed(
    tmp_path: Path, watcher: list[_Watcher]
) -> None:
    run = tmp_path / "runs" / "gpt"  # not there yet: the job has not started
    w = _Watcher(str(run))
    watcher.append(w)
    w.wait_for("not there yet", "err")
    version = run / "version_0"
    version.mkdir(parents=True)
    log = version / "stability.jsonl"
    records = [StepRecord(i, {"loss": 2.5 - 0.001 * i, "grad_norm": 0.5}) for i in range(20)]
    records.append(StepRecord(20, {"loss": math.nan, "grad_norm": math.nan}))
    log.write_text("".join(r.to_json() + "\n" for r in records))
    w.wait_for("step 20 error nonfinite_loss")  # a NaN at step 20: all of it is new
    assert w.interrupt() == 1
    assert not any("Is a directory" in line for line in w.err), w.err
    assert sum("waiting" in line for line in w.err) == 1, w.err  # said once


def test_a_path_that_never_appeared_says_so(tmp_path: Path, watcher: list[_Watcher]) -> None:
    w = _Watcher(str(tmp_path / "never.log"))
    watcher.append(w)
    w.wait_for("not there yet", "err")
    assert w.interrupt() == 2
    assert any("never.log: never appeared while it was watched" in line for line in w.err)
    assert not any("no training steps" in line for line in w.err + w.out), w.err


def test_an_update_is_printed_as_it_comes_with_its_advice(tmp_path: Path) -> None:
    """A ``stability.jsonl`` of a protected fp32 run: the NaN's step was skipped (no
    "skip_step") and the run is fp32 (no fp32 islands), as every output advises it."""
    header = {"type": "run", "precision": "32-true", "policy": "protect", "groups": []}
    records = [StepRecord(i, {"loss": 2.0, "grad_norm": 0.5, "skipped": 0.0}) for i in range(30)]
    records.append(StepRecord(30, {"loss": math.nan, "grad_norm": math.nan, "skipped": 1.0}))
    log = tmp_path / "stability.jsonl"
    lines = [json.dumps(header), *(r.to_json() for r in records)]
    log.write_text("".join(line + "\n" for line in lines))
    with log.open("rb") as stdin:
        done = _run_watch(["-"], stdin)
    [line] = [line for line in done.stdout.splitlines() if " nonfinite_loss" in line]
    assert line.endswith("loss is nan at step 30: roll back to the last good checkpoint and "
                         "step past the bad batch -> try: rollback"), line  # fmt: skip
