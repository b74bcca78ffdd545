"""Shared fixtures: each failure scenario is trained once per test session, for real.

``pytest --sweep`` also runs the tests marked ``sweep``: every scenario's claim over seeds 0-4 and
1 and 2 torch threads (``tests/scenario_sweep.py``; ~15 min on 2 quiet CPU cores).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from scenario_claims import Trace

from stabilizer.callbacks.demo.run import ScenarioRun, run_scenario
from stabilizer.callbacks.monitor import StabilityMonitor


@dataclass
class TracedRun:
    """A scenario trained with the ``Trace`` and an observing ``StabilityMonitor`` attached."""

    run: ScenarioRun
    trace: Trace
    monitor: StabilityMonitor
    log_dir: Path  # TensorBoard event files and stability.jsonl


_CACHE: dict[str, TracedRun] = {}


@pytest.fixture(scope="session")
def scenario_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], TracedRun]:
    """``scenario_run(name)`` trains the preset once per session and returns the traced run.

    The monitor observes only: these runs show each failure as it happens without protection
    (``test_protect.py`` and ``test_auto.py`` train with the other policies). They train with the
    machine's torch threads; the sweep (``--sweep``) checks every claim on 1 and 2 threads.
    """

    def get(name: str) -> TracedRun:
        if name not in _CACHE:
            trace, monitor = Trace(), StabilityMonitor(policy="observe")
            root = tmp_path_factory.mktemp(name)
            logger = TensorBoardLogger(save_dir=str(root), name=name)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run = run_scenario(
                    name, accelerator="cpu", callbacks=[trace, monitor], logger=logger,
                    trainer_args={"log_every_n_steps": 1},  # every record in TensorBoard too
                )  # fmt: skip
            _CACHE[name] = TracedRun(run, trace, monitor, Path(logger.log_dir))
        return _CACHE[name]

    return get


@pytest.fixture(autouse=True, scope="session")
def _quiet_lightning() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread for a module of tiny models: they gain nothing from threads, and on a
    busy shared CPU the intra-op thread pool slows a training step down by ~50x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--sweep",
        action="store_true",
        help="also run the scenario sweep (every claim over seeds 0-4 x 1 and 2 threads)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "sweep: the scenario sweep; runs only with --sweep")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--sweep"):
        return
    skip = pytest.mark.skip(reason="the scenario sweep runs with --sweep (~15 min)")
    for item in items:
        if "sweep" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def sweep_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Curves of every scenario for seeds 0-4 x 1 and 2 threads, trained once per session."""
    from scenario_sweep import SEEDS, THREADS, sweep

    out = tmp_path_factory.mktemp("sweep")
    sweep(SEEDS, THREADS, out)
    return out


def loop_host(
    module: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    precision: str = "32-true",
    lr: float = 1e-3,
) -> Any:
    """A plain loop's host of the step (`stabilizer.hosts.loop.LoopHost`) around `module` (a
    ``Linear(2, 2)`` by default) and its AdamW: for tests that drive the step's parts by hand."""
    from stabilizer.hosts.loop import LoopHost
    from stabilizer.step.host import HostFacts

    module = module if module is not None else torch.nn.Linear(2, 2)
    optimizer = optimizer or torch.optim.AdamW(module.parameters(), lr=lr)
    return LoopHost(module, [optimizer], [], None, HostFacts(precision=precision))


@pytest.fixture
def watcher() -> Iterator[list[Any]]:
    """`stabilizer watch` processes a test starts (test_watch's ``_Watcher``), killed after it."""
    started: list[Any] = []
    yield started
    for w in started:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait()


@pytest.fixture
def hook() -> Iterator[Any]:
    """A real HTTP server recording the webhook's POSTs (test_notify's ``_Hook``)."""
    import threading

    from test_notify import _Hook

    server = _Hook()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
