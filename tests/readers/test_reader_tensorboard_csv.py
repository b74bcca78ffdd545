"""TensorBoard's CSV and JSON downloads of one scalar (written by TensorBoard's own scalars
plugin): the tag from the file's name, the console log's findings."""

from __future__ import annotations

from pathlib import Path

import pytest
from reader_cases import parse
from tracker_cases import RUNS, TRACKERS, console_findings, findings

from stabilizer.replay.readers import Note, detect_format, read_log
from stabilizer.replay.readers.trackers.tensorboard_csv import tag_of

DOWNLOADS = TRACKERS / "tensorboard"


@pytest.mark.parametrize("form", ["csv", "json"])
@pytest.mark.parametrize("run", RUNS)
def test_a_download_gives_the_console_logs_findings(run: str, form: str, tmp_path: Path) -> None:
    path = DOWNLOADS / f"run-{run}-tag-train_loss.{form}"
    assert detect_format(path) == "tensorboard_csv"
    assert findings(path) == console_findings(run, tmp_path, loss_only=True)


@pytest.mark.parametrize(
    ("name", "tag"),
    [
        ("run-version_0-tag-train_loss.csv", "train_loss"),
        ("run-.-tag-grad_norm.json", "grad_norm"),
        ("run-a-tag-b-tag-lr-AdamW.csv", "lr-AdamW"),
        ("loss.csv", "loss"),
    ],
)
def test_the_tag_is_in_the_name(name: str, tag: str) -> None:
    assert tag_of(f"/some/where/{name}") == tag


def test_the_value_is_what_the_name_says(tmp_path: Path) -> None:
    """A gradient norm's download is no loss; a note says where the name came from."""
    path = tmp_path / "run-version_0-tag-grad_norm.csv"
    path.write_text("Wall time,Step,Value\n1.0,1,0.5\n2.0,2,nan\n")
    notes: list[Note] = []
    items = list(read_log(path, notes=notes))
    assert [item.values for item in items] == [{"grad_norm": 0.5}, {"grad_norm": float("nan")}] or (
        items[1].values["grad_norm"] != items[1].values["grad_norm"]  # type: ignore[union-attr]
    )
    assert any("'grad_norm'" in n.message for n in notes)


def test_odd_rows_are_skipped_and_reading_goes_on() -> None:
    text = "Wall time,Step,Value\n1.0,1,2.5\nx,y,z\n1.0,nan,2\n3.0,2,2.4\n"
    assert [r.step for r in parse("tensorboard_csv", text)] == [1, 2]
