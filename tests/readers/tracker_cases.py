"""Shared by the tracker tests: the fixtures of ``tests/fixtures/trackers`` (written by its
``make.py`` with the trackers themselves), the findings each run must give (its console log's),
and a guard that nothing leaves the machine."""

from __future__ import annotations

import importlib.util
import ipaddress
import socket
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from stabilizer.replay.diagnose import diagnose

TRACKERS = Path(__file__).resolve().parents[1] / "fixtures" / "trackers"
RUNS = ("healthy", "spike", "nan")
Found = list[tuple[str, int, int | None, str]]


def _make() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tracker_make", TRACKERS / "make.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAKE = _make()
"""The fixture writer: its runs' numbers (``series``) and console logs (``console``)."""


def findings(path: str | Path) -> Found:
    """What `diagnose` finds in a log or a store's run: (kind, step, end step, severity)."""
    diagnosis = diagnose(str(path))
    return [
        (item.finding.kind, item.finding.step, item.finding.end_step, str(item.finding.severity))
        for item in diagnosis.findings
    ]


def console_findings(run: str, tmp_path: Path, loss_only: bool = False) -> Found:
    """The findings of the console log that prints ``run``'s numbers (its loss alone, for an
    export of the loss alone)."""
    text = MAKE.console(run)
    if loss_only:
        lines = [f"step {s} | loss {loss}" for s, loss, _ in MAKE.series(run)]
        text = "\n".join(lines) + "\n"
    log = tmp_path / f"{run}{'-loss' if loss_only else ''}.log"
    log.write_text(text)
    return findings(log)


def _local(address: Any) -> bool:
    if not isinstance(address, tuple):  # AF_UNIX: a path on this machine
        return True
    host = str(address[0])
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Every connection a test opens goes to this machine (loopback); any other fails the
    test. Yields the addresses connected to."""
    tried: list[Any] = []
    connect, connect_ex = socket.socket.connect, socket.socket.connect_ex

    def guarded(sock: socket.socket, address: Any) -> Any:
        tried.append(address)
        if not _local(address):
            raise AssertionError(f"a connection off this machine: {address!r}")
        return connect(sock, address)

    def guarded_ex(sock: socket.socket, address: Any) -> Any:
        tried.append(address)
        if not _local(address):
            raise AssertionError(f"a connection off this machine: {address!r}")
        return connect_ex(sock, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    monkeypatch.setattr(socket.socket, "connect_ex", guarded_ex)
    yield tried
    assert all(_local(address) for address in tried)
