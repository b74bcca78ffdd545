"""A README or a source file is no training log: "no training records", exit 2, no episode."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from stabilizer.cli import main
from stabilizer.replay.document import document_kind

ROOT = Path(__file__).resolve().parents[2]
REAL = ROOT / "tests" / "fixtures" / "real" / "logs"


def test_markdown_and_source_are_documents() -> None:
    two = ["## A", "see [x](y)", "## B", "some text", "more text", "step 1 loss 2"]
    assert document_kind(two) == "a markdown document"
    readme = ["# Tool", "Install it, see [docs](d).", "## Use", "```", "tool run", "```"]
    assert document_kind([*readme, "some prose", "more prose", "step 1 loss 2"]) == (
        "a markdown document"
    )
    assert document_kind(["import math", "from x import y", "print('step 1 loss nan')"]) == (
        "Python source code"
    )


def test_a_fenced_log_is_no_document() -> None:
    """A log is told apart from a README by its training records, not by its fences: a
    fenced paste (issue #32: refused as markdown) and an issue with headings around its log."""
    assert document_kind(["# Title", "", "```text", "step 1 loss nan", "```"]) is None
    issue = ["### Bug", "see [x](y)", "### Logs", "```", *(f"step {i} loss 2" for i in range(5))]
    assert document_kind(issue) is None


def test_logs_are_no_documents() -> None:
    """Config dumps' comments (mmdet's ``# model settings``), one heading, one import: a log."""
    mmdet = ["# model settings", "model = dict(type='RetinaNet')", "Epoch [1][50/100] loss: 2.1"]
    assert document_kind(mmdet) is None
    assert document_kind(["import failed: no module named apex", "step 1 loss 2.0"]) is None
    for path in sorted(REAL.glob("*.log")):
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        assert document_kind(lines) is None, path.name


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("README.md", "a markdown document"),  # quotes real log excerpts, NaNs among them
        ("stabilizer/core/detectors/loss_spike.py", "Python source code"),
    ],
)
def test_diagnose_calls_a_document_no_training_records(path: str, kind: str) -> None:
    result = CliRunner().invoke(main, ["diagnose", str(ROOT / path)])
    assert result.exit_code == 2
    assert f"no training records: this is {kind}, not a training log" in result.stderr
    assert "episode" not in result.output
