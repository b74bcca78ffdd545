"""trackio: a project's SQLite file gives each run the console log's findings; watch follows a
run that trackio is writing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from reader_cases import only_records
from tracker_cases import RUNS, TRACKERS, console_findings, findings, no_network

from stabilizer.cli import main
from stabilizer.replay.readers import Note, read_log
from stabilizer.replay.watch import Watch

__all__ = ["no_network"]  # the fixture, used by name

DB = TRACKERS / "trackio" / "demo.db"


@pytest.mark.parametrize("run", RUNS)
def test_a_run_of_a_project(run: str, tmp_path: Path, no_network: list[object]) -> None:
    assert findings(f"{DB}#{run}") == console_findings(run, tmp_path)


def test_every_run_of_a_project_and_nothing_changed(tmp_path: Path) -> None:
    db = tmp_path / "demo.db"
    shutil.copyfile(DB, db)
    before = db.read_bytes()
    result = CliRunner().invoke(main, ["diagnose", str(db)])
    assert [line for line in result.output.splitlines() if line.startswith("diagnosis")] == [
        f"diagnosis of {db}#{run}" for run in RUNS
    ]
    assert db.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["demo.db"]
    notes: list[Note] = []
    records = only_records(list(read_log(db, notes=notes)))
    assert len(records) == 120 and any("newest, nan" in n.message for n in notes)


@pytest.mark.slow
def test_watch_follows_a_run_trackio_writes(tmp_path: Path) -> None:
    """trackio itself writes (its WAL-mode file, from a background thread), a step at a time:
    the file appears after the watch began; a second run is followed from its start."""
    pytest.importorskip("trackio", reason="trackio, to write the run")
    script = (
        "import math, time, trackio\n"
        "trackio.init(project='live', name='r0')\n"
        "for s in range(1, 31):\n"
        "    trackio.log({'train/loss': 3 - 0.01 * s}, step=s)\n"
        "    time.sleep(0.03)\n"
        "trackio.finish()\n"
        "time.sleep(1.5)\n"
        "trackio.init(project='live', name='r1')\n"
        "for s in range(1, 61):\n"
        "    trackio.log({'train/loss': math.nan if s >= 45 else 3 - 0.01 * s}, step=s)\n"
        "    time.sleep(0.03)\n"
        "trackio.finish()\n"
    )
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    alerts: list[tuple[str, bool]] = []
    watch = Watch([str(tmp_path / "live.db")], lambda a: alerts.append((a.finding.kind, a.live)))
    writer = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.DEVNULL)
    stopper = threading.Thread(target=lambda: (writer.wait(120), time.sleep(1.5), watch.stop()))
    stopper.start()
    (outcome,) = watch.run()
    stopper.join()
    assert ("nonfinite_loss", True) in alerts
    segments = outcome.segments  # type: ignore[union-attr]
    assert [(s.first_step, s.last_step, s.why) for s in segments] == [
        (1, 30, ""),
        (1, 60, "a new run: run r1 began (segment 2)"),
    ]
    found = [(f.segment, f.finding.kind) for f in outcome.findings]  # type: ignore[union-attr]
    assert found == [(2, "nonfinite_loss")]
