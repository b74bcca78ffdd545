"""``stabilizer diagnose`` on hostile inputs: pipes, devices, damaged gzip, link loops, /proc.

What a user's disk can hold besides a clean log. Pipes, devices and symbolic links are made here
(a repository cannot hold them); files are in ``tests/fixtures/hostile`` (``make_hostile.py``).
"""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from stabilizer.cli import main
from stabilizer.core.records import StepRecord
from stabilizer.replay.readers import read_log

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "tests" / "fixtures" / "logs"
HOSTILE = ROOT / "tests" / "fixtures" / "hostile"
NANOGPT = LOGS / "nanogpt_failing.log"  # 603 records, steps 0-599, one loss spike
CSV = LOGS / "lightning_csv_failing" / "metrics.csv"  # 400 records
POSIX = pytest.mark.skipif(os.name != "posix", reason="pipes and symbolic links")


def run(*args: str | Path) -> Result:
    result = CliRunner().invoke(main, ["diagnose", *map(str, args)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    return result


def records(path: Path) -> list[int]:
    return [item.step for item in read_log(path) if isinstance(item, StepRecord)]


def plain(tmp_path: Path, data: bytes) -> list[int]:
    """The steps of ``data`` written as a plain file: what a hostile copy of it must give."""
    (tmp_path / "plain.log").write_bytes(data)
    return records(tmp_path / "plain.log")


def report(result: Result) -> list[str]:
    """The report's lines after the first (which names the input)."""
    return result.stdout.splitlines()[1:]


# --- named pipes and devices ----------------------------------------------------------------------


@POSIX
def test_a_named_pipe_with_no_writer_is_refused_after_the_wait(tmp_path: Path) -> None:
    fifo = tmp_path / "train.log"
    os.mkfifo(fifo)
    code = (
        "from stabilizer.replay.readers import _source\n"
        "_source.PIPE_WAIT = 0.5\n"
        "from stabilizer.cli import main\n"
        "main()\n"
    )
    # In a process of its own: the code before the fix waited for a writer forever.
    done = subprocess.run(
        [sys.executable, "-c", code, "diagnose", str(fifo)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr == (
        f"stabilizer diagnose: error: {fifo}: a pipe that nothing was written to in 0.5 s\n"
    )


@POSIX
def test_a_named_pipe_with_a_writer_streams(tmp_path: Path) -> None:
    fifo = tmp_path / "train.log"
    os.mkfifo(fifo)

    def write() -> None:
        with open(fifo, "wb") as pipe:  # waits for the reader to open its end
            pipe.write(NANOGPT.read_bytes())

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    result = run(fifo)
    writer.join(timeout=60)
    assert result.exit_code == 1
    assert report(result) == report(run(NANOGPT))  # the same as the file itself


@POSIX
@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null"])
def test_a_device_is_refused_with_one_line(device: str) -> None:
    if not Path(device).exists():
        pytest.skip(f"no {device}")
    result = run(device)
    assert result.exit_code == 2
    assert (
        result.stderr
        == f"stabilizer diagnose: error: {device}: a device or a socket, not a log file\n"
    )


def readable_prefix(path: Path) -> bytes:
    """What gzip itself can unpack of ``path`` before the damage."""
    readable = bytearray()
    with open(path, "rb") as raw, gzip.GzipFile(fileobj=raw) as unpacked:
        try:
            while piece := unpacked.read1(1 << 16):
                readable += piece
        except (EOFError, gzip.BadGzipFile):
            pass
    return bytes(readable)


# --- damaged gzip: read up to the damage, with a note ---------------------------------------------


@pytest.mark.parametrize(
    ("name", "damage"),
    [
        ("truncated_end.log.gz", "Compressed file ended before"),
        ("bad_crc.log.gz", "CRC check failed"),
    ],
    ids=["truncated", "bad-crc"],
)
def test_a_small_damaged_gzip_is_read_up_to_the_damage(
    name: str, damage: str, tmp_path: Path
) -> None:
    result = run(HOSTILE / name, "--fail-on", "critical")
    assert result.exit_code == 0, result.output
    readable = readable_prefix(HOSTILE / name)
    steps = plain(tmp_path, readable[: readable.rindex(b"\n") + 1])  # its complete lines
    assert len(steps) > 300
    assert f"records   {len(steps)}, steps {min(steps)}–{max(steps)}\n" in result.stdout
    assert f"damaged gzip data ({damage}" in result.stdout
    assert "bytes: read up to there" in result.stdout


def test_a_large_damaged_gzip_keeps_every_line_before_the_damage(tmp_path: Path) -> None:
    # Lines of 100 bytes, 3 MiB of them: the readers read ahead by 1 MiB chunks, and a damage
    # raised into a read-ahead used to cost the chunk before it.
    lines = b"".join(b"step=%07d loss=%-78.6f\n" % (step, 3.0) for step in range(1, 30_001))
    packed = gzip.compress(lines, mtime=0)
    log = tmp_path / "train.log.gz"
    log.write_bytes(packed[: len(packed) * 9 // 10])
    complete = readable_prefix(log).count(b"\n")
    assert complete > 20_000
    notes: list[object] = []
    stream = read_log(log, notes=notes)  # type: ignore[arg-type]
    steps = [item.step for item in stream if isinstance(item, StepRecord)]
    assert steps[:complete] == list(range(1, complete + 1))
    assert any("damaged gzip data" in str(note) for note in notes)


def test_a_gzip_damaged_in_its_header_is_one_line() -> None:
    result = run(HOSTILE / "gzip_header_only.gz")
    assert result.exit_code == 2
    assert result.stderr.startswith(
        f"stabilizer diagnose: error: {HOSTILE / 'gzip_header_only.gz'}: "
    )
    assert result.stderr.count("\n") == 1


# --- directory walks: inside the directory, each real directory once ------------------------------


@POSIX
def test_a_link_out_of_the_directory_is_not_followed(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "metrics.csv").write_bytes(CSV.read_bytes())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "up").symlink_to("..")
    result = run(run_dir)
    assert result.exit_code == 2
    assert result.stderr == (
        f"stabilizer diagnose: error: {run_dir}: nothing readable in this directory (looked for "
        "stability.jsonl, events.out.tfevents.*, run-*.wandb, metrics.csv, trainer_state.json)\n"
    )


@POSIX
def test_links_to_the_directory_itself_visit_it_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "version_0").mkdir(parents=True)
    (run_dir / "version_0" / "metrics.csv").write_bytes(CSV.read_bytes())
    for k in range(3):  # before the fix: 3^4 paths to one file, taken for 40 runs
        (run_dir / f"self{k}").symlink_to(".")
    (run_dir / "latest").symlink_to("version_0")  # a link inside the directory is followed
    result = run(run_dir, "--json")
    assert result.exit_code == 1
    assert '"records": 400' in result.stdout
    assert "runs in" not in result.stdout  # one run, not one per path to it


@POSIX
def test_a_link_inside_the_directory_is_followed(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / ".hidden" / "v0").mkdir(parents=True)  # hidden directories are not walked ...
    (run_dir / ".hidden" / "v0" / "metrics.csv").write_bytes(CSV.read_bytes())
    (run_dir / "latest").symlink_to(".hidden/v0")  # ... but a link to one, inside, is
    assert records(run_dir) == records(CSV)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_a_read_error_is_named_a_read_error() -> None:
    # /proc/self links to / (root), the working directory, and files the user may not read.
    result = run("/proc/self")
    assert result.exit_code == 2
    assert "cannot write" not in result.stderr
    assert result.stderr.startswith("stabilizer diagnose: error: /proc/self: nothing readable")


# --- the hostile fixture files, each as the user would meet it ------------------------------------


@pytest.mark.parametrize(
    ("name", "status", "expected"),
    [
        ("events.out.tfevents.1714550400.int64_max", 0, "steps 1–9223372036854775807"),
        ("nested_too_deep.jsonl", 0, "records   1,"),
        ("binary_noise.bin", 2, "binary data, neither a text log nor an event file"),
    ],
    ids=["int64-max-step", "nested-json", "binary"],
)
def test_hostile_fixture(name: str, status: int, expected: str) -> None:
    result = run(HOSTILE / name)
    assert result.exit_code == status, result.output
    assert expected in result.output


def test_a_page_of_nuls_loses_at_most_the_line_it_lands_in(tmp_path: Path) -> None:
    # What a crash leaves: a page of NULs written over the middle of a line.
    log = NANOGPT.read_bytes()
    clean = plain(tmp_path, log[:9000])
    steps = records(HOSTILE / "nul_page.log")
    assert len(clean) - 1 <= len(steps) <= len(clean)
    assert steps[-1] == clean[-1]  # the lines after the page are read


@pytest.mark.parametrize(
    ("name", "decode"),
    [("utf16.log", lambda b: b.decode("utf-16").encode()), ("lone_cr.log", lambda b: b)],
    ids=["utf16", "lone-cr"],
)
def test_an_odd_encoding_reads_as_its_plain_copy(
    name: str, decode: Callable[[bytes], bytes], tmp_path: Path
) -> None:
    plain_copy = decode((HOSTILE / name).read_bytes()).replace(b"\r", b"\n")
    assert len(plain(tmp_path, plain_copy)) > 50
    assert records(HOSTILE / name) == plain(tmp_path, plain_copy)
