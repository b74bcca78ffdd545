"""`TensorBoardReader`: checked against TensorBoard's own ``EventAccumulator``; damage."""

from __future__ import annotations

import math
import shutil
import struct
from collections import defaultdict
from pathlib import Path

import pytest
from reader_cases import findings, fixture, kinds, only_records, records, restarts, serious
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from tensorboard.util import tensor_util

from stabilizer.core.records import StepRecord
from stabilizer.replay.readers import Item, Note, TensorBoardReader, read_log
from stabilizer.replay.readers._keys import KeyMap
from stabilizer.replay.readers.tensorboard import WINDOW

RUNS = ["tensorboard_healthy/version_0", "tensorboard_failing/version_0", "tensorboard_stability",
        "tensorboard_tf2"]  # fmt: skip


def accumulated(run: Path) -> list[StepRecord]:
    """TensorBoard's reading of a run, every scalar kept, grouped and mapped as ours."""
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    raw: dict[int, dict[str, float]] = defaultdict(dict)
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            raw[event.step][tag] = event.value
    for tag in acc.Tags()["tensors"]:
        for event in acc.Tensors(tag):
            raw[event.step][tag] = float(tensor_util.make_ndarray(event.tensor_proto))
    keys = KeyMap()
    return [StepRecord(step, keys.values(raw[step])) for step in sorted(raw)]


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.split("/")[0])
def test_same_steps_and_values_as_event_accumulator(run: str) -> None:
    ours = list(read_log(fixture(run)))
    theirs = accumulated(fixture(run))
    assert [r.step for r in ours] == [r.step for r in theirs]
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine.values.keys() == reference.values.keys()
        for key, value in mine.values.items():
            assert value == pytest.approx(reference.values[key], rel=1e-6, nan_ok=True), key


def test_lightning_tags_map_to_signals() -> None:
    recs = records("tensorboard_healthy")
    assert recs[0].step == 0 and recs[0].values["hp_metric"] == -1.0
    assert set(recs[5].values) == {
        "loss", "epoch", "lr", "grad_norm", "hp_metric" if recs[5].step == 0 else "grad_norm/embed",
        "grad_norm/head", *(f"grad_norm/block_{i:02d}" for i in range(6)),
    }  # fmt: skip
    assert recs[5].values["lr"] == pytest.approx(3e-4)
    assert not serious(findings(recs))


def test_failing_run_starves_the_input_end() -> None:
    found = [f for f in findings(records("tensorboard_failing")) if f.kind == "depth_imbalance"]
    assert kinds(found) == {"depth_imbalance"}
    assert set(found[0].location) == {"block_00", "block_01", "block_02"}


def test_interleaved_events_merge_into_their_step() -> None:
    recs = records("tensorboard_stability")  # each step's clip_val arrives after the next step
    assert [r.step for r in recs] == list(range(120))
    assert all(r.values["clip_val"] == 5.0 and "loss_scale" in r.values for r in recs)


def test_tf2_tensor_scalars() -> None:
    recs = records("tensorboard_tf2")
    assert len(recs) == 100 and recs[1].values.keys() == {"loss", "lr"}
    assert recs[0].values["lr"] == pytest.approx(1e-3)


def copy_run(tmp_path: Path) -> Path:
    (source,) = fixture("tensorboard_stability").glob("events.out.tfevents.*")
    target = tmp_path / source.name
    shutil.copy(source, target)
    return target


def test_truncated_file_is_read_up_to_the_damage(tmp_path: Path) -> None:
    path = copy_run(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    notes: list[Note] = []
    recs = list(read_log(path, notes=notes))
    assert 50 < len(recs) < 70 and [r.step for r in recs] == list(range(len(recs)))
    (note,) = [n for n in notes if n.kind == "truncated"]
    assert note.message.startswith("truncated record at byte ")
    assert note.message.endswith("read the event file up to there")


def test_corrupt_header_stops_with_a_note(tmp_path: Path) -> None:
    path = copy_run(tmp_path)
    data = bytearray(path.read_bytes())
    offset, count = 0, 0
    while count < 40:  # find the 40th record and break its length CRC
        offset += 16 + struct.unpack_from("<Q", data, offset)[0]
        count += 1
    data[offset + 8] ^= 0xFF
    path.write_bytes(bytes(data))
    notes: list[Note] = []
    recs = list(read_log(path, notes=notes))
    assert 10 < len(recs) < 25
    assert [n.message for n in notes if n.kind == "truncated"] == [
        f"corrupt record header at byte {offset}: read the event file up to there"
    ]


def test_data_crc_checked_when_asked(tmp_path: Path) -> None:
    path = copy_run(tmp_path)
    data = bytearray(path.read_bytes())
    data[-6] ^= 0x01  # a bit of the last event's float
    path.write_bytes(bytes(data))
    notes: list[Note] = []
    with path.open("rb") as stream:
        recs = list(TensorBoardReader(notes, verify=True).read(stream))
    assert len(recs) == 120 and "clip_val" not in recs[-1].values  # the last event is lost
    assert [n.message.split(" at ")[0] for n in notes] == ["corrupt record data"]


def write_events(directory: Path, events: list[tuple[int, str, float]]) -> None:
    writer = EventFileWriter(str(directory))
    for step, tag, value in events:
        summary = summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)]
        )
        writer.add_event(event_pb2.Event(wall_time=1.0, step=step, summary=summary))
    writer.close()


def read_items(directory: Path, notes: list[Note] | None = None) -> list[Item]:
    """The items of the one event file in ``directory``."""
    (path,) = directory.glob("events.out.tfevents.*")
    with path.open("rb") as stream:
        return list(TensorBoardReader(notes).read(stream))


def test_restart_within_a_file_and_window(tmp_path: Path) -> None:
    steps = [*range(WINDOW + 10), 5, 6]
    write_events(tmp_path, [(s, "loss", 1.0) for s in steps])
    notes: list[Note] = []
    found = read_items(tmp_path, notes)
    assert [r.step for r in only_records(found)] == steps
    assert restarts(found) == [(5, None, f"step went back from {WINDOW + 9} to 5")]
    assert found.index(restarts_of(found)[0]) == WINDOW + 10 and not notes


def restarts_of(found: list[Item]) -> list[Item]:
    return [item for item in found if not isinstance(item, StepRecord)]


def session_start(step: int) -> event_pb2.Event:
    log = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
    return event_pb2.Event(wall_time=1.0, step=step, session_log=log)


def test_a_session_start_after_records_is_a_restart(tmp_path: Path) -> None:
    """TensorBoard's own loader reads ``session_log`` START as a restart; so do we, even where
    the steps go on (the run resumed from its last step's checkpoint)."""
    writer = EventFileWriter(str(tmp_path))
    writer.add_event(session_start(0))  # a run's first session: no restart
    for step in range(100):
        if step == 60:
            writer.add_event(session_start(60))
        value = summary_pb2.Summary.Value(tag="loss", simple_value=2.0)
        writer.add_event(event_pb2.Event(step=step, summary=summary_pb2.Summary(value=[value])))
    writer.close()
    found = read_items(tmp_path)
    assert [r.step for r in only_records(found)] == list(range(100))
    assert restarts(found) == [(60, None, "a new session started (session_log START)")]
    assert found.index(restarts_of(found)[0]) == 60


def test_late_text_event_is_no_restart(tmp_path: Path) -> None:
    # The monitor writes a finding's text at the episode's first step, long after that step.
    writer = EventFileWriter(str(tmp_path))
    for step in range(WINDOW + 10):
        value = summary_pb2.Summary.Value(tag="loss", simple_value=1.0)
        writer.add_event(event_pb2.Event(step=step, summary=summary_pb2.Summary(value=[value])))
    text = summary_pb2.Summary.Value(tag="stability/findings")
    text.tensor.string_val.append(b"divergence")
    text.metadata.plugin_data.plugin_name = "text"
    writer.add_event(event_pb2.Event(step=3, summary=summary_pb2.Summary(value=[text])))
    writer.close()
    notes: list[Note] = []
    assert read_items(tmp_path, notes) == [
        StepRecord(step, {"loss": 1.0}) for step in range(WINDOW + 10)
    ]
    assert not notes


def test_files_of_a_run_merge_by_step(tmp_path: Path) -> None:
    write_events(tmp_path, [(s, "train/loss", 2.0) for s in range(5)])
    write_events(tmp_path, [(s, "lr-SGD", 0.1) for s in range(3, 8)])
    (tmp_path / "events.out.tfevents.0.empty").write_bytes(b"")
    notes: list[Note] = []
    recs = list(read_log(tmp_path, notes=notes))
    assert [r.step for r in recs] == list(range(8))
    assert recs[3].values == {"loss": 2.0, "lr": pytest.approx(0.1)}
    assert "2 event files merged by step" in [n.message for n in notes]


def test_nan_inf_and_step_zero_survive(tmp_path: Path) -> None:
    write_events(
        tmp_path, [(0, "loss", math.nan), (0, "grad_norm", math.inf), (2**40, "loss", -1.0)]
    )
    first, second = read_log(tmp_path)
    assert (
        first.step == 0
        and math.isnan(first.values["loss"])
        and first.values["grad_norm"] == math.inf
    )
    assert second == StepRecord(2**40, {"loss": -1.0})


def test_short_restart_within_the_window_keeps_both_segments(tmp_path: Path) -> None:
    """Steps 0-99, then 50-149 (fewer than WINDOW back): a restart, not a merge (regression)."""
    first = [(s, tag, float(s)) for s in range(100) for tag in ("loss", "lr")]
    second = [(s, tag, -float(s)) for s in range(50, 150) for tag in ("loss", "lr")]
    write_events(tmp_path, first + second)
    found = list(read_log(tmp_path))
    recs = only_records(found)
    assert [r.step for r in recs] == [*range(100), *range(50, 150)]
    assert all(r.values["loss"] == r.step for r in recs[:100])
    assert all(r.values["loss"] == -r.step for r in recs[100:])
    assert restarts(found) == [(50, None, "step went back from 99 to 50")]
    assert found.index(restarts_of(found)[0]) == 100


def test_multi_scalar_events_restart_within_the_window(tmp_path: Path) -> None:
    writer = EventFileWriter(str(tmp_path))
    for step in [*range(30), *range(20, 40)]:
        values = [summary_pb2.Summary.Value(tag=t, simple_value=1.0) for t in ("loss", "lr")]
        writer.add_event(event_pb2.Event(step=step, summary=summary_pb2.Summary(value=values)))
    writer.close()
    found = list(read_log(tmp_path))
    assert [r.step for r in only_records(found)] == [*range(30), *range(20, 40)]
    assert restarts(found) == [(20, None, "step went back from 29 to 20")]


def test_files_of_a_run_merged_restart_where_the_steps_go_back(tmp_path: Path) -> None:
    """Two files, one of which restarted within itself: the merged steps go back once."""
    write_events(tmp_path, [(s, "loss", 2.0) for s in [*range(10), *range(5, 10)]])
    write_events(tmp_path, [(s, "lr-SGD", 0.1) for s in range(3)])
    found = list(read_log(tmp_path))
    assert [r.step for r in only_records(found)] == [*range(10), *range(5, 10)]
    assert restarts(found) == [(5, None, "step went back from 9 to 5")]
