"""`read_log` and `detect_format`: detection, gzip, stdin, directories, and every error."""

from __future__ import annotations

import gzip
import io
import os
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
from reader_cases import CASES, fixture, items, records, restarts

from stabilizer.core.records import StepRecord
from stabilizer.replay.readers import (
    READERS,
    Item,
    LogReadError,
    Note,
    Restart,
    detect_format,
    read_log,
)
from stabilizer.replay.readers._lines import text_lines


@pytest.mark.parametrize("name", CASES, ids=str)
def test_detect_format_of_every_fixture(name: str) -> None:
    assert detect_format(fixture(name)) == CASES[name][0]


@pytest.mark.parametrize("name", [n for n in CASES if fixture(n).is_file()], ids=str)
def test_detect_format_from_lines(name: str) -> None:
    head = fixture(name).read_text(encoding="utf-8").splitlines()[:50]
    assert detect_format(head) == CASES[name][0]


def test_every_format_is_registered_once() -> None:
    assert list(READERS) == [
        "jsonl", "lightning_csv", "csv", "tensorboard", "tensorboard_csv", "wandb", "wandb_csv",
        "megatron", "deepspeed", "hf_trainer", "hf_trainer_state", "fairseq", "generic",
    ]  # fmt: skip
    assert all(cls.format == name for name, cls in READERS.items())


def test_explicit_format_skips_detection() -> None:
    recs = list(read_log(fixture("generic_healthy.log"), format="generic"))
    assert recs == records("generic_healthy.log")


def test_gzip_text_and_event_files(tmp_path: Path) -> None:
    for name in ("megatron_healthy.log", "tensorboard_stability"):
        source = fixture(name)
        if source.is_dir():
            (source,) = source.glob("events.out.tfevents.*")
        target = tmp_path / (source.name + ".gz")
        target.write_bytes(gzip.compress(source.read_bytes()))
        assert list(read_log(target)) == list(read_log(source))


def test_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    data = fixture("nanogpt_healthy.log").read_bytes()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(gzip.compress(data))))
    assert list(read_log("-")) == records("nanogpt_healthy.log")


def test_directory_picks_the_newest_run(tmp_path: Path) -> None:
    for version in (0, 1):
        shutil.copytree(fixture("lightning_csv_healthy"), tmp_path / "logs" / f"version_{version}")
    os.utime(tmp_path / "logs/version_0/metrics.csv", (1, 1))
    notes: list[Note] = []
    assert len(list(read_log(tmp_path, notes=notes))) == 400
    assert [n.kind for n in notes] == ["source", "source"]
    assert notes[0].message.endswith("reading the newest, " + str(tmp_path / "logs/version_1"))


def test_utf16_and_crlf(tmp_path: Path) -> None:
    path = tmp_path / "train.log"
    text = fixture("nanogpt_healthy.log").read_text().replace("\n", "\r\n")
    path.write_bytes(text.encode("utf-16"))
    assert list(read_log(path)) == records("nanogpt_healthy.log")


def test_over_long_line_is_skipped_with_bounded_memory(tmp_path: Path) -> None:
    path = tmp_path / "train.log"
    with path.open("wb") as out:
        out.write(b"iter 1: loss 2.0, time 1ms, mfu 1%\n")
        chunk = b"x" * (1 << 20)
        for _ in range(100):  # one 100 MiB line
            out.write(chunk)
        out.write(b"\niter 2: loss 2.1, time 1ms, mfu 1%\n")
    notes: list[Note] = []
    tracemalloc.start()
    try:
        recs = list(read_log(path, notes=notes))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [r.step for r in recs] == [1, 2]
    assert [str(n) for n in notes] == [f"line 2: over-long line (> {1 << 20} characters) skipped"]
    assert peak < 32 << 20


def test_text_lines_split_progress_bars_and_strip_ansi() -> None:
    data = b"a\r\nb\rc\x1b[31mred\x1b[0m\n\xff\n"
    assert list(text_lines(io.BytesIO(data), [])) == ["a", "b", "cred", "\ufffd"]


def test_missing_path() -> None:
    with pytest.raises(LogReadError, match=r"^nope\.log: no such file or directory$"):
        read_log("nope.log")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads anything")
def test_permission_denied(tmp_path: Path) -> None:
    path = tmp_path / "train.log"
    path.write_text("iter 1: loss 2.0, time 1ms, mfu 1%\n")
    path.chmod(0)
    with pytest.raises(LogReadError, match=r"train\.log: permission denied$"):
        read_log(path)


def test_empty_file(tmp_path: Path) -> None:
    (tmp_path / "train.log").write_bytes(b"")
    with pytest.raises(LogReadError, match=r"train\.log: empty file$"):
        read_log(tmp_path / "train.log")
    (tmp_path / "empty.gz").write_bytes(gzip.compress(b""))
    with pytest.raises(LogReadError, match=r"empty\.gz: empty file$"):
        read_log(tmp_path / "empty.gz")


def test_binary_garbage(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(bytes(range(256)) * 64)
    with pytest.raises(
        LogReadError, match=r"model\.bin: binary data, neither a text log nor an event"
    ):
        read_log(path)
    with pytest.raises(LogReadError, match=r"model\.bin: binary data, not a megatron log$"):
        read_log(path, format="megatron")


def test_corrupt_gzip(tmp_path: Path) -> None:
    path = tmp_path / "train.log.gz"
    path.write_bytes(b"\x1f\x8b\x08\x00" + b"\x00" * 40)
    with pytest.raises(LogReadError, match=r"train\.log\.gz: cannot read \("):
        read_log(path)


def test_a_text_log_no_reader_knows_reads_as_generic(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("dear diary,\ntoday the loss went down.\n")
    stream = read_log(path)
    assert stream.format == "generic" and list(stream) == []
    assert stream.head_lines() == ["dear diary,", "today the loss went down."]
    assert detect_format(["hello", "world"]) == "generic"


def test_old_format_names_read_as_generic() -> None:
    assert read_log(fixture("nanogpt_healthy.log"), format="nanogpt").format == "generic"
    assert read_log(fixture("nanogpt_healthy.log"), format="modded_nanogpt").format == "generic"
    with pytest.raises(
        LogReadError, match=r"`format` must be auto or one of jsonl, .*, got 'xml'$"
    ):
        read_log(fixture("nanogpt_healthy.log"), format="xml")


def test_directory_with_nothing_readable(tmp_path: Path) -> None:
    (tmp_path / "hparams.yaml").write_text("lr: 0.1\n")
    with pytest.raises(
        LogReadError, match=r"nothing readable in this directory \(looked for stability"
    ):
        read_log(tmp_path)
    with pytest.raises(
        LogReadError, match=r"a directory reads as jsonl, .*, not megatron: pass a file"
    ):
        read_log(tmp_path, format="megatron")


def test_readers_import_neither_torch_nor_lightning() -> None:
    code = (
        "import sys, stabilizer.replay.readers; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'lightning', 'numpy'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


MEGATRON = (
    " iteration {:8d}/ 2000000 | consumed samples: 512 | elapsed time per iteration (ms): 1234.5 |"
    " learning rate: 3.000E-04 | global batch size:   512 | lm loss: 3.1E+00 | loss scale: 4096.0"
    " | grad norm: 0.812 | number of skipped iterations:   0 | number of nan iterations:   0 |"
)
FAIRSEQ = (
    "2024-01-01 12:00:00 | INFO | train_inner | epoch 001:  7 / 2000 loss=3.1, nll_loss=9.0, "
    "ppl=512, wps=31234.5, ups=3.12, wpb=10012.3, bsz=128, num_updates={}, lr=0.0005, "
    "gnorm=1.234, clip=0, loss_scale=128, train_wall=32"
)


def test_a_resumed_run_has_its_restart_in_the_stream() -> None:
    """The resumed fixture: a crash at iteration 380, resumed from the iteration-250 checkpoint;
    the `Restart` comes just before the resumed process's first record."""
    found = items("nanogpt_resumed.log")
    (at,) = [i for i, item in enumerate(found) if isinstance(item, Restart)]
    assert found[at] == Restart(250, 398, "resume banner 'Resuming training from out'")
    before, after = found[at - 1], found[at + 1]
    assert isinstance(before, StepRecord) and isinstance(after, StepRecord)
    assert before.step == 379 and after.step == 250 and "val_loss" in after.values


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_restart_comes_just_before_the_record_it_starts(name: str) -> None:
    """The reader contract `diagnose` relies on, for every fixture (one of them resumed)."""
    restart_comes_with_its_record(items(name))


@pytest.mark.parametrize(("format", "line"), [("megatron", MEGATRON), ("fairseq", FAIRSEQ)])
def test_restarts_within_a_run(format: str, line: str, tmp_path: Path) -> None:
    steps = [*range(1, 400), *range(200, 500), *range(450, 900)]
    lines = [line.format(step) for step in steps]
    lines.insert(len(lines) - 300, "Resuming training from checkpoint at iteration 600")
    path = tmp_path / "run.log"
    path.write_text("\n".join(lines) + "\n")
    found = list(read_log(path, format))
    restart_comes_with_its_record(found)
    assert restarts(found) == [
        (200, 400, "step went back from 399 to 200"),
        (450, 700, "step went back from 499 to 450"),
        (600, 851, "resume banner 'Resuming training from checkpoint at iteration 600'"),
    ]


def restart_comes_with_its_record(found: list[Item]) -> None:
    """Each `Restart` is followed by a record of its step, and never comes first."""
    for at, item in enumerate(found):
        if isinstance(item, Restart):
            assert at > 0 and isinstance(found[at - 1], StepRecord), at
            following = found[at + 1]
            assert isinstance(following, StepRecord) and following.step == item.step, at
