"""One function decides which remedies fit the run, and every output calls it (#33).

The same finding got different advice in the console, the JSONL, TensorBoard, ``watch`` and
the ``diagnose`` verdict, each with a rule of its own. Here `fitting_remedies` is wrapped by a
spy that puts a remedy of its own first: every output of a real run, live and replayed, must
show it, so that none decides with a rule of its own.
"""

from __future__ import annotations

import importlib
import json
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator
from test_console import VOCAB, TinyLM
from torch.utils.data import DataLoader, TensorDataset

from stabilizer.callbacks import StabilityMonitor
from stabilizer.core import advice
from stabilizer.core.records import Finding, Severity
from stabilizer.outputs.tensorboard import FINDINGS_TAG
from stabilizer.replay.diagnose import diagnose
from stabilizer.report import render_markdown, render_text, report_dict
from stabilizer.report.tensorboard_export import TensorBoardExport
from stabilizer.report.verdict import verdict
from stabilizer.report.watching import WatchSession

pytestmark = pytest.mark.usefixtures("one_thread")

# (the package's `incidents` is the function: the module by its name)
report_incidents = importlib.import_module("stabilizer.report.incidents")

SPY = "spy_remedy"


@pytest.fixture
def spied(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, ...]]]:
    """`fitting_remedies` wherever it is called, answering with `SPY` first."""
    calls: list[tuple[str, ...]] = []
    real = advice.fitting_remedies

    def spy(
        remedies: Sequence[str],
        findings: Sequence[Finding],
        facts: advice.RunFacts,
        *,
        recovered: bool | None = None,
    ) -> tuple[str, ...]:
        calls.append(tuple(remedies))
        return (SPY, *real(remedies, findings, facts, recovered=recovered))

    for module in (advice, report_incidents):  # (the reports' incidents import it by name)
        monkeypatch.setattr(module, "fitting_remedies", spy)
    yield calls


def test_every_output_advises_by_the_one_function(
    tmp_path: Path, spied: list[tuple[str, ...]], caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    logger = TensorBoardLogger(str(tmp_path), name="run", version=0)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=10, logger=logger, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0,
        callbacks=[StabilityMonitor()],
    )  # fmt: skip
    data = TensorDataset(torch.randint(0, VOCAB, (40, 8)))
    with caplog.at_level(logging.INFO, logger="stabilizer"):
        trainer.fit(TinyLM(nan_every=8), DataLoader(data, batch_size=4))  # a NaN at step 6
    run = tmp_path / "run" / "version_0"
    assert spied

    # Live: the console, the JSONL, TensorBoard's findings table.
    [console] = [r.getMessage() for r in caplog.records if "error nonfinite_loss" in r.getMessage()]
    assert f"-> try: {SPY}" in console
    lines = [json.loads(line) for line in (run / "stability.jsonl").read_text().splitlines()]
    [logged] = [d for d in lines if d["type"] == "finding" and d["kind"] == "nonfinite_loss"]
    assert logged["remedies"][0] == SPY
    assert f"`{SPY}`" in _findings_text(run)

    # Replayed: the text and markdown reports, the verdict, the JSON report, the export.
    with TensorBoardExport(tmp_path / "export") as export:
        diagnosis = diagnose(str(run / "stability.jsonl"), sinks=[export])
        export.finish(diagnosis)
    assert f"({SPY})" in render_text(diagnosis) and f"(`{SPY}`)" in render_markdown(diagnosis)
    assert verdict(diagnosis, Severity.WARNING).endswith(f": {SPY}")
    report = report_dict([diagnosis], Severity.WARNING)
    [found] = [f for f in report["findings"] if f["kind"] == "nonfinite_loss"]
    assert found["remedies"][0] == SPY
    assert f"`{SPY}`" in _findings_text(tmp_path / "export")

    # `watch`: its line of the NaN.
    assert f"-> try: {SPY}" in _watched(run / "stability.jsonl")


def _findings_text(logdir: Path) -> str:
    events = EventAccumulator(str(logdir), {TENSORS: 0})
    events.Reload()
    return str(events.Tensors(FINDINGS_TAG)[-1].tensor_proto.string_val[0].decode())


def _watched(path: Path) -> str:
    """The line `stabilizer watch --from-start` prints for the log's NaN."""
    said: list[str] = []
    session = WatchSession([str(path)], said.append, lambda line: None, from_start=True)
    thread = threading.Thread(target=session.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not any("error nonfinite_loss" in line for line in said):
        assert time.monotonic() < deadline, said
        time.sleep(0.05)
    session.watch.stop()
    thread.join(60)
    return next(line for line in said if "error nonfinite_loss" in line)
