"""`Notifier` against a real HTTP server on 127.0.0.1, a real command, and a real Trainer run."""

from __future__ import annotations

import json
import logging
import threading
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from stabilizer.core.records import Finding, Severity
from stabilizer.outputs.notify import Notifier, as_notifier, redact


class _Hook(ThreadingHTTPServer):
    """Records every POST's JSON; answers ``fail`` of them with 500 first."""

    def __init__(self, fail: int = 0) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.posts: list[dict[str, Any]] = []
        self.fail = fail
        self.arrived = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/services/T000/B000/secret-token"


class _Handler(BaseHTTPRequestHandler):
    server: _Hook

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.server.fail:
            self.server.fail -= 1
            self.send_response(500)
            self.end_headers()
            return
        self.server.posts.append(json.loads(body))
        self.server.arrived.set()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _nan(step: int, severity: Severity = Severity.ERROR, message: str = "loss is nan") -> Finding:
    return Finding("nonfinite_loss", step, step, severity, message)


def test_one_message_per_episode_and_the_close_when_asked(hook: _Hook) -> None:
    notifier = Notifier(webhook=hook.url, close=True)
    opened = _nan(10, message="loss is nan <!channel> & more")
    persists = _nan(10, Severity.CRITICAL, "persists")
    closed = _nan(10, Severity.INFO, "finite again")
    spike = Finding("loss_spike", 20, 22, Severity.WARNING, "spike")  # below the level
    assert notifier.notify([opened, persists, spike]) == 1
    assert notifier.notify([closed, closed]) == 1
    notifier.close(timeout=30)
    assert [p["stabilizer"]["event"] for p in hook.posts] == ["open", "close"]
    text = hook.posts[0]["text"]
    assert "step 10 error nonfinite_loss" in text and "&lt;!channel&gt; &amp;" in text
    assert hook.posts[0]["stabilizer"]["finding"] == opened.to_dict()


def test_an_episode_is_the_consoles_episode() -> None:
    """#34: the notifier kept an episode rule of its own; it now keeps the one of
    `stabilizer.core.episode`: a NaN that names every depth group and its "persists" that names
    none are one episode, two bands of one step two."""
    notifier = Notifier(command="true", level="warning", close=True)
    groups = ("embed", "block_00", "head")
    first = Finding("nonfinite_loss", 10, 10, Severity.ERROR, "loss is nan", location=groups)
    persists = _nan(10, Severity.CRITICAL, "persists")
    assert [notifier.due(f) for f in (first, persists)] == ["open", ""]
    assert notifier.due(_nan(10, Severity.INFO, "finite again")) == "close"
    bands = [Finding("depth_imbalance", 7, 9, Severity.WARNING, "x", location=(g,)) for g in groups]
    assert [notifier.due(f) for f in bands] == ["open"] * 3
    assert notifier.due(first, where="other.log") == "open"  # another log's episode


def test_server_errors_are_retried(hook: _Hook) -> None:
    hook.fail = 2
    notifier = Notifier(webhook=hook.url, retries=2, backoff=0.01)
    notifier.notify([_nan(5)])
    notifier.close(timeout=30)
    assert len(hook.posts) == 1 and notifier.failed == 0


def test_a_dead_endpoint_costs_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    server = _Hook()
    url = server.url
    server.server_close()  # nothing listens there any more
    notifier = Notifier(webhook=url, retries=1, backoff=0.01, timeout=2)
    with caplog.at_level(logging.WARNING, logger="stabilizer"):
        notifier.notify([_nan(1), _nan(2), _nan(3)])
        notifier.close(timeout=30)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and notifier.failed == 3, warned
    assert "secret-token" not in warned[0] and "127.0.0.1" in warned[0]


def test_command_gets_the_finding_on_stdin_and_in_its_environment(tmp_path: Path) -> None:
    out = tmp_path / "finding.json"
    env = tmp_path / "env.txt"
    command = f'cat > {out}; echo "$STABILIZER_KIND $STABILIZER_SEVERITY $STABILIZER_STEP" > {env}'
    notifier = Notifier(command=command)
    notifier.notify([_nan(7)], where="train.log")
    notifier.close(timeout=30)
    assert json.loads(out.read_text())["finding"]["step"] == 7
    assert env.read_text().split() == ["nonfinite_loss", "error", "7"]


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="needs a `webhook` or a `command`"):
        Notifier()
    with pytest.raises(ValueError, match="http or https URL, got 'ftp://host/…'"):
        Notifier(webhook="ftp://host/secret")
    with pytest.raises(ValueError, match="`timeout` must be > 0, got 0"):
        Notifier(command="true", timeout=0)
    with pytest.raises(ValueError, match="`severity` must be one of"):
        Notifier(command="true", level="loud")
    with pytest.raises(TypeError, match="`notify` must be a Notifier"):
        as_notifier(3)  # type: ignore[arg-type]
    assert redact("https://hooks.slack.com/services/T/B/x") == "https://hooks.slack.com/…"
    assert "x" not in repr(Notifier(webhook="https://hooks.slack.com/services/T/B/x"))


@pytest.mark.usefixtures("one_thread")
def test_trainer_run_notifies_the_nan_once(hook: _Hook) -> None:
    from stabilizer.callbacks.demo.run import run_scenario
    from stabilizer.callbacks.monitor import StabilityMonitor

    monitor = StabilityMonitor(policy="observe", jsonl=False, notify=hook.url)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_scenario("nan-16-true", steps=70, accelerator="cpu", callbacks=[monitor])
    sent = [p["stabilizer"]["finding"] for p in hook.posts]
    kinds = [(f["kind"], f["step"]) for f in sent]
    assert kinds and len(kinds) == len(set(kinds)), kinds  # each episode once
    assert any(kind == "nonfinite_loss" for kind, _ in kinds), kinds
    found = {(f.kind, f.step) for f in monitor.findings if f.severity >= Severity.ERROR}
    assert set(kinds) == found
