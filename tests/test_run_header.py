"""The run's facts open ``stability.jsonl``: read back as an item of the stream, used by the
replayed advice as the live console uses them (#21); logs without them still read."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from stabilizer.core.records import Severity, StepRecord
from stabilizer.core.run import RunHeader
from stabilizer.replay.diagnose import diagnose
from stabilizer.replay.readers import read_log
from stabilizer.report import report_dict
from stabilizer.report.incidents import incidents
from stabilizer.report.text import render_text

sys.path.insert(0, str(Path(__file__).parent))

from test_console import TinyLM, _fit

pytestmark = pytest.mark.usefixtures("one_thread")


class ModuleNaN(TinyLM):
    """A NaN made by the model at step 6 (not in the loss): the case the precision decides."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for i, block in enumerate(self.blocks):
            x = x + torch.tanh(block(x))
            if i == 1 and self.training and self.trainer.global_step == 6:
                x = x * float("nan")
        out: torch.Tensor = self.head(x)
        return out


def test_round_trip_and_defaults() -> None:
    header = RunHeader("bf16-mixed", "cuda", 8, "FSDPStrategy", 16, "auto", ("embed",), "0.1.0")
    assert RunHeader.from_dict(json.loads(header.to_json())) == header
    assert header.low_precision is True
    assert RunHeader("32-true").low_precision is False and RunHeader().low_precision is None
    # A later version may add facts, an earlier one lack some: both read.
    assert RunHeader.from_dict({"type": "run", "precision": "16-mixed", "new": 1}).devices == 1


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"type": "step"}, "`type` must be 'run'"),
        ({"type": "run", "devices": 0}, "`devices` must be an integer >= 1, got 0"),
        ({"type": "run", "groups": "embed"}, "`groups` must be a list of names"),
        ({"type": "run", "precision": 32}, "`precision` must be a string, got 32"),
    ],
    ids=["type", "devices", "groups", "precision"],
)
def test_a_bad_header_is_refused(data: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RunHeader.from_dict(data)


def test_the_reader_yields_the_header_as_an_item(tmp_path: Path) -> None:
    log = tmp_path / "stability.jsonl"
    header = RunHeader("32-true", "cpu", 1, "SingleDeviceStrategy", 1, "protect", ("embed",))
    steps = [StepRecord(step, {"loss": 2.0}).to_json() for step in range(3)]
    log.write_text("\n".join([header.to_json(), *steps, '{"type":"run","devices":"x"}']) + "\n")
    stream = read_log(log)
    items = list(stream)
    assert items[0] == header and [r.step for r in items[1:]] == [0, 1, 2]  # type: ignore[union-attr]
    assert [n.message for n in stream.notes if n.kind == "skipped"] == [
        "1 line(s) not JSON records: skipped"  # a broken header is a bad line, not a crash
    ]


def test_replayed_advice_of_an_fp32_run_fits_it(tmp_path: Path) -> None:
    """A real fp32 run whose model makes a NaN: the live console offers no fp32 islands, and
    now neither does the replay of its JSONL; without the header (an older log) nothing is
    assumed and they are offered, as before."""
    _fit(tmp_path, ModuleNaN(), steps=10)
    [jsonl] = tmp_path.rglob("stability.jsonl")
    first = json.loads(jsonl.read_text().splitlines()[0])
    assert first["type"] == "run" and first["precision"] == "32-true"
    assert first["groups"] == ["embed", "block_00", "block_01", "head"]

    diagnosis = diagnose(str(jsonl))
    assert diagnosis.run is not None and diagnosis.run.policy == "protect"
    [incident] = [e for e in incidents(diagnosis) if e.worst.kind == "nonfinite_loss"]
    assert "upcast_to_fp32" not in incident.remedies
    assert incident.recovered and "rollback" not in incident.remedies  # (#33: skipped, recovered)
    assert "fp32's range" in incident.cause and "fp16" not in incident.cause
    text = render_text(diagnosis)
    assert "run       32-true on 1 cpu, SingleDeviceStrategy, policy protect" in text
    assert "fp32 islands" not in text and "bf16" not in text
    report = report_dict([diagnosis], Severity.WARNING)
    assert report["inputs"][0]["run"]["precision"] == "32-true"

    old = tmp_path / "old.jsonl"  # the same log as written before the header existed
    old.write_text("\n".join(jsonl.read_text().splitlines()[1:]) + "\n")
    before = diagnose(str(old))
    assert before.run is None
    [incident] = [e for e in incidents(before) if e.worst.kind == "nonfinite_loss"]
    assert "upcast_to_fp32" in incident.remedies
