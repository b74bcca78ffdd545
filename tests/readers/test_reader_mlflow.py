"""MLflow: its SQLite store, its ``mlruns/`` tree and a tracking server give the console log's
findings, each run as a run of ``diagnose PATH...``."""

from __future__ import annotations

import logging
import math
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from reader_cases import only_records
from tracker_cases import MAKE, RUNS, TRACKERS, console_findings, findings, no_network

from stabilizer.cli import main
from stabilizer.replay.readers import LogReadError, Note, detect_format, read_log
from stabilizer.replay.watch import Watch

__all__ = ["no_network"]  # the fixture, used by name

DB = TRACKERS / "mlflow.db"
MLRUNS = TRACKERS / "mlruns"


@pytest.mark.parametrize("run", RUNS)
def test_a_run_of_the_sqlite_store(run: str, tmp_path: Path, no_network: list[object]) -> None:
    """Named by its name or its id; HF's MLflowCallback names (``loss``, ``eval_loss``)."""
    expected = console_findings(run, tmp_path)
    run_id = _ids(DB)[RUNS.index(run)]  # (the runs were made in the order of RUNS)
    assert findings(f"{DB}#{run}") == findings(f"{DB}#{run_id}") == expected


def test_the_store_is_read_as_it_was_and_never_changed(tmp_path: Path) -> None:
    db = tmp_path / "mlflow.db"
    shutil.copyfile(DB, db)
    db.chmod(0o444)  # read-only, as an archived store may be
    before = db.read_bytes()
    records = only_records(list(read_log(f"{db}#nan")))
    assert db.read_bytes() == before and not (tmp_path / "mlflow.db-journal").exists()
    assert [r.step for r in records] == list(range(1, 121))
    assert math.isnan(records[-1].values["loss"]) and records[24].values["val_loss"] > 0


def test_nan_and_inf_are_read_back_as_logged(tmp_path: Path) -> None:
    """MLflow stores NaN as 0 with ``is_nan`` and inf as the largest float."""
    db = tmp_path / "mlflow.db"
    shutil.copyfile(DB, db)
    with sqlite3.connect(db) as connection:
        (run,) = connection.execute("SELECT run_uuid FROM runs WHERE name = 'healthy'").fetchone()
        connection.execute(
            "UPDATE metrics SET value = 1.7976931348623157e308 WHERE run_uuid = ? AND step = 50 "
            "AND key = 'loss'",
            (run,),
        )
    found = {r.step: r.values for r in only_records(list(read_log(f"{db}#{run}")))}
    assert found[50]["loss"] == math.inf
    assert findings(f"{db}#{run}")[0][:2] == ("nonfinite_loss", 50)


def test_the_newest_run_alone_and_every_run_with_diagnose() -> None:
    notes: list[Note] = []
    stream = read_log(DB, notes=notes)
    assert stream.format == detect_format(DB) == detect_format(MLRUNS) == "mlflow"
    assert any("3 runs" in n.message and "newest, nan" in n.message for n in notes)
    result = CliRunner().invoke(main, ["diagnose", str(DB)])
    assert [line for line in result.output.splitlines() if line.startswith("diagnosis of")] == [
        f"diagnosis of {DB}#{run_id}" for run_id in _ids(DB)
    ]
    assert result.exit_code == 1
    assert CliRunner().invoke(main, ["diagnose", f"{DB}#nope"]).exit_code == 2


def _ids(db: Path) -> list[str]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as connection:
        query = "SELECT run_uuid FROM runs ORDER BY start_time, run_uuid"
        return [row[0] for row in connection.execute(query)]


@pytest.mark.parametrize("run", RUNS)
def test_a_run_of_the_file_store(run: str, tmp_path: Path) -> None:
    """Lightning's MLFlowLogger names (``train_loss``, ``lr-AdamW``, ``val_loss``)."""
    assert findings(_run_dir(run)) == console_findings(run, tmp_path)


def _run_dir(run: str) -> Path:
    (meta,) = [p for p in MLRUNS.glob("*/*/meta.yaml") if f"run_name: {run}\n" in p.read_text()]
    return meta.parent


def test_the_tree_and_an_experiment_are_each_of_their_runs() -> None:
    (experiment,) = [p for p in MLRUNS.iterdir() if p.name not in ("0", ".trash")]
    for top in (MLRUNS, experiment):
        result = CliRunner().invoke(main, ["diagnose", str(top)])
        assert result.output.count("diagnosis of") == 3, result.output
        assert "overall" in result.output.lower() or result.exit_code == 1


def test_a_metric_file_still_being_written(tmp_path: Path) -> None:
    """A last line without its end is left for the next look."""
    copy = tmp_path / "run"
    shutil.copytree(_run_dir("healthy"), copy)
    with open(copy / "metrics" / "train_loss", "a") as file:
        file.write("1714550400000 nan")  # cut: no step, no end
    records = only_records(list(read_log(copy)))
    assert records[-1].step == 120 and not math.isnan(records[-1].values["loss"])


@pytest.mark.slow
def test_watch_follows_a_run_the_file_store_writes(tmp_path: Path) -> None:
    """MLflow itself writes (``MLFLOW_ALLOW_FILE_STORE``), a step at a time."""
    pytest.importorskip("mlflow", reason="the mlflow extra")
    script = (
        "import math, mlflow, time\n"
        f"mlflow.set_tracking_uri({(tmp_path / 'mlruns').as_uri()!r})\n"
        "mlflow.set_experiment('live')\n"
        "time.sleep(1.5)\n"  # the watch begins before the run
        "with mlflow.start_run(run_name='live'):\n"
        "    for s in range(1, 61):\n"
        "        loss = math.nan if s >= 45 else 3 - 0.01 * s\n"
        "        mlflow.log_metrics({'train_loss': loss}, step=s)\n"
        "        time.sleep(0.03)\n"
    )
    env = {**os.environ, "MLFLOW_ALLOW_FILE_STORE": "true", "MLFLOW_DISABLE_TELEMETRY": "true"}
    alerts: list[tuple[str, bool]] = []
    watch = Watch(
        [str(tmp_path / "mlruns")], lambda a: alerts.append((a.finding.kind, a.live)), poll=0.05
    )
    writer = subprocess.Popen([sys.executable, "-c", script], env=env)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("mlruns/*/meta.yaml")) and time.monotonic() < deadline:
        time.sleep(0.1)  # the store, before its run
    stopper = threading.Thread(target=lambda: (writer.wait(120), time.sleep(1.5), watch.stop()))
    stopper.start()
    (outcome,) = watch.run()
    stopper.join()
    assert ("nonfinite_loss", True) in alerts
    assert outcome.records == 60  # type: ignore[union-attr]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    """A local MLflow tracking server on loopback, its runs logged through it: MLflow's own
    server app (its REST handlers and SQL store), served by werkzeug in this process (the
    ``mlflow server`` command's uvicorn workers take a minute to start on 2 loaded cores)."""
    pytest.importorskip("mlflow", reason="the mlflow extra")
    from werkzeug.serving import make_server

    os.environ.update(
        MLFLOW_DISABLE_TELEMETRY="true",
        _MLFLOW_SERVER_FILE_STORE=f"sqlite:///{tmp_path / 'server.db'}",
        _MLFLOW_SERVER_ARTIFACT_ROOT=str(tmp_path / "artifacts"),
    )
    from mlflow.server import app

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    http = make_server("127.0.0.1", 0, app)
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    uri = f"http://127.0.0.1:{http.server_port}"
    try:
        _log_runs(uri)
        yield uri
    finally:
        http.shutdown()
        http.server_close()


def _log_runs(uri: str) -> None:
    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    for run in RUNS:
        created = client.create_run("0", run_name=run)
        metrics = [
            Metric(key, value, 1_714_550_400_000 + step, step)
            for step, loss, grad in MAKE.series(run)
            for key, value in (("loss", loss), ("grad_norm", grad), ("learning_rate", MAKE.LR))
        ]
        for start in range(0, len(metrics), 900):
            client.log_batch(created.info.run_id, metrics=metrics[start : start + 900])
        client.set_terminated(created.info.run_id)


@pytest.mark.slow
def test_a_tracking_server(server: str, tmp_path: Path, no_network: list[object]) -> None:
    """``mlflow:<uri>``: every run diagnosed; one run by ``#<name>``; nothing but loopback."""
    for run in RUNS:
        assert findings(f"mlflow:{server}#{run}") == console_findings(run, tmp_path)
    result = CliRunner().invoke(main, ["diagnose", f"mlflow:{server}"])
    assert result.output.count("diagnosis of mlflow:") == 3 and result.exit_code == 1
    assert no_network and all(address[0] == "127.0.0.1" for address in no_network)  # type: ignore[index]


def test_a_server_that_does_not_answer_is_one_line() -> None:
    pytest.importorskip("mlflow", reason="the mlflow extra")
    port = _free_port()
    result = CliRunner().invoke(main, ["diagnose", f"mlflow:http://127.0.0.1:{port}"])
    assert result.exit_code == 2
    (line,) = [line for line in result.output.splitlines() if line]
    assert line.startswith(f"stabilizer diagnose: error: mlflow:http://127.0.0.1:{port}: ")


def test_without_the_extra_a_server_says_which_to_install() -> None:
    script = (
        "import sys; sys.modules['mlflow'] = None\n"
        "from stabilizer.cli import main\n"
        "main(['diagnose', 'mlflow:http://127.0.0.1:9'])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "stabilizer diagnose: error: reading an MLflow tracking server needs the mlflow extra: "
        "pip install 'stabilizer-lightning[mlflow]'"
    ]


def test_not_a_store_is_no_store(tmp_path: Path) -> None:
    """Another SQLite file is read as what it is (binary: refused), never written to."""
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as connection:
        connection.execute("CREATE TABLE t (a)")
    before = other.read_bytes()
    with pytest.raises(LogReadError, match="binary"):
        read_log(other)
    assert other.read_bytes() == before
