"""Fuzzing ``stabilizer diagnose`` with every output option: whatever the log and the flags, the
exit status is 0, 1 or 2 and nothing escapes as a traceback.

The logs are real fixture logs cut, garbled, spliced with hostile lines and gzipped (maybe
truncated), the hostile fixtures of ``tests/fixtures/hostile``, noise, run directories and
standard input. The flags are every combination of ``--json``, ``--markdown``, ``--plot``,
``--tensorboard``, ``--force``, ``--fail-on`` and ``--format``, with outputs that are new, already
there, symbolic links, files where a directory belongs and folders that do not exist. Beyond the
exit status: a JSON report parses and agrees with the exit status; what was there before is kept
(a link's target always, anything else unless ``--force``); no temporary file is left behind.

Deterministic (``derandomize``, no example database) and sized for CI on 2 cores; the ``slow``
sweep runs the same properties on more examples.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from stabilizer.cli import main
from stabilizer.replay.readers import READERS

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "tests" / "fixtures" / "logs"
HOSTILE = ROOT / "tests" / "fixtures" / "hostile"
TEXT_LOGS = sorted(p for p in LOGS.iterdir() if p.suffix in {".log", ".jsonl"})
RUN_DIRS = sorted(p for p in LOGS.iterdir() if p.is_dir())
HOSTILE_FILES = sorted(p for p in HOSTILE.iterdir() if p.name != "make_hostile.py")
PNG = b"\x89PNG\r\n\x1a\n"
MINE = b"the user's own bytes"
POSIX = os.name == "posix"


def _settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# Lines no trainer writes, spliced into real logs: steps past int64 and past any float, values
# past float32, NULs (what a crash leaves), a BOM, lone carriage returns, deep JSON, huge numbers.
SPLICES = [
    b"",
    b"step=18446744073709551621 loss=2.5\n",
    b'{"type": "step", "step": 1' + b"0" * 400 + b', "values": {"loss": 2.5}}\n',
    b"iter 9223372036854775808: loss 1e39, time 1ms, mfu 1%\n",
    b"step=5 loss=1.7976931348623157e308 grad_norm=-1e39\n",
    b"\x00" * 4096,
    b"\xef\xbb\xbfstep=1 loss=nan\r\r",
    b'{"type": "step", "step": 2, "values": ' + b"[" * 5000 + b"\n",
    b"step=-3 loss=inf grad_norm=nan\n",
    b"Resuming training from checkpoint at step 0\n",
]


@st.composite
def log_bytes(draw: st.DrawFn) -> tuple[str, bytes]:
    """A log's file name and bytes: a real or hostile log, damaged, or noise."""
    kind = draw(st.sampled_from(["fixture", "fixture", "hostile", "noise"]))
    if kind == "noise":
        return "noise.log", draw(st.binary(max_size=2000))
    source = draw(st.sampled_from(TEXT_LOGS if kind == "fixture" else HOSTILE_FILES))
    raw = source.read_bytes()
    cut = draw(st.integers(0, 3)) == 3  # mostly whole: hypothesis favours the small numbers
    end = draw(st.integers(0, len(raw))) if cut else len(raw)
    data = bytearray(raw[:end])
    for at, byte in draw(
        st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=4)
    ):
        if data:
            data[at % len(data)] = byte
    at = draw(st.integers(0, len(data)))
    data[at:at] = draw(st.sampled_from(SPLICES))
    if kind == "fixture" and draw(st.integers(0, 3)) == 3:
        packed = gzip.compress(bytes(data), mtime=0)
        keep = draw(st.sampled_from([len(packed), len(packed) - 8, len(packed) * 2 // 3, 10]))
        return source.name + ".gz", packed[:keep]
    return source.name, bytes(data)


@dataclass
class Case:
    """One invocation: its arguments, standard input, and what must be kept as it was."""

    args: list[str] = field(default_factory=list)
    stdin: bytes = b""
    kept: dict[Path, bytes] = field(default_factory=dict)  # path -> bytes it must still hold
    allowed: set[str] = field(default_factory=set)  # names the output folder may hold after


def _inputs(draw: st.DrawFn, out: Path, case: Case) -> int:
    """Add 1 or 2 inputs to ``case``: fuzzed files, a real run directory, standard input."""
    count = draw(st.integers(1, 2))
    for index in range(count):
        kind = draw(st.sampled_from(["file", "file", "dir", "stdin"] if index == 0 else ["file"]))
        if kind == "dir":
            case.args.append(str(draw(st.sampled_from(RUN_DIRS))))
            continue
        name, data = draw(log_bytes())
        if kind == "stdin":
            case.args.append("-")
            case.stdin = data
            continue
        folder = out / f"in{index}"
        folder.mkdir()
        (folder / name).write_bytes(data)
        case.args.append(str(folder / name))
        case.allowed.add(folder.name)
    return count


def _plot(draw: st.DrawFn, out: Path, case: Case, count: int) -> None:
    """Maybe a ``--plot``: new, already there, a link, without a suffix, in no folder, a folder."""
    state = draw(
        st.sampled_from([None, *["new"] * 4, "there", "link", "noext", "nofolder", "folder"])
    )
    if state is None:
        return
    target = out / ("report" if state == "noext" else "report.png")
    if state == "there":
        target.write_bytes(MINE)
        case.kept[target] = MINE
    elif state == "link" and POSIX:
        (out / "elsewhere.txt").write_bytes(MINE)
        target.symlink_to("elsewhere.txt")
        case.kept[out / "elsewhere.txt"] = MINE
        case.allowed.add("elsewhere.txt")
    elif state == "nofolder":
        target = out / "no" / "such" / "report.png"
    elif state == "folder":
        target.mkdir()
    case.args += ["--plot", str(target)]
    stem, suffix = target.stem, target.suffix
    case.allowed |= {target.name, *(f"{stem}-{i}{suffix}" for i in range(1, count + 1))}


def _tensorboard(draw: st.DrawFn, out: Path, case: Case) -> None:
    """Maybe a ``--tensorboard``: new, empty, holding a file of the user's, a file, a link."""
    state = draw(st.sampled_from([None, *["new"] * 4, "empty", "mine", "file", "link"]))
    if state is None:
        return
    target = out / "tb"
    if state == "empty":
        target.mkdir()
    elif state == "mine":
        target.mkdir()
        (target / "notes.txt").write_bytes(MINE)
        case.kept[target / "notes.txt"] = MINE
    elif state == "file":
        target.write_bytes(MINE)
        case.kept[target] = MINE
    elif state == "link" and POSIX:
        (out / "real_tb").mkdir()
        target.symlink_to("real_tb")
        case.allowed.add("real_tb")
    case.args += ["--tensorboard", str(target)]
    case.allowed.add(target.name)


def _flags(draw: st.DrawFn, case: Case) -> None:
    """The report flags: --json, --markdown (both: a usage error), --fail-on, --format, --force."""
    case.args += draw(
        st.sampled_from([[], ["--json"], ["--json"], ["--markdown"], ["--json", "--markdown"]])
    )
    level = draw(st.sampled_from([None, "info", "warning", "error", "critical"]))
    case.args += [] if level is None else ["--fail-on", level]
    fmt = draw(st.sampled_from([*[None] * 3 * len(READERS), *READERS]))  # mostly detected
    case.args += [] if fmt is None else ["--format", fmt]
    case.args += ["--force"] if draw(st.booleans()) else []


@st.composite
def cases(draw: st.DrawFn, out: Path, plot: bool, tensorboard: bool) -> Case:
    """An invocation of ``diagnose`` whose outputs (if any) go to ``out``."""
    case = Case()
    count = _inputs(draw, out, case)
    if plot:
        _plot(draw, out, case, count)
    if tensorboard:
        _tensorboard(draw, out, case)
    _flags(draw, case)
    return case


def diagnose(case: Case) -> Result:
    """Run ``diagnose``; the exit status is 0, 1 or 2, and no exception escapes."""
    result = CliRunner().invoke(main, ["diagnose", *case.args], input=case.stdin)
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        case.args,
        result.exc_info,
    )
    assert result.exit_code in (0, 1, 2), (case.args, result.output)
    assert "Traceback" not in result.output, (case.args, result.output)
    return result


def check(case: Case, result: Result, out: Path) -> None:
    """The properties every run keeps, besides its exit status."""
    if "--json" in case.args and result.stdout:
        report = json.loads(result.stdout)  # strict JSON: no NaN, no Infinity
        assert report["summary"]["exit_code"] == result.exit_code, case.args
    force = "--force" in case.args
    for path, data in case.kept.items():
        if path.exists() and not path.is_dir() and not (force and path.suffix == ".png"):
            assert path.read_bytes() == data, (case.args, path)
    for path in out.iterdir():
        assert path.name in case.allowed, (case.args, path)  # no temporary file left
        picture = path.suffix == ".png" and path.is_file() and not path.is_symlink()
        if picture and path.read_bytes() != MINE:
            assert path.read_bytes().startswith(PNG), (case.args, path)  # whole, or not at all


def fuzz(data: st.DataObject, plot: bool, tensorboard: bool) -> None:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        case = data.draw(cases(out, plot, tensorboard))
        result = diagnose(case)
        event(f"exit {result.exit_code}")
        check(case, result, out)


@_settings(60)
@given(data=st.data())
def test_any_log_any_report_flags(data: st.DataObject) -> None:
    fuzz(data, plot=False, tensorboard=False)


@_settings(30)
@given(data=st.data())
def test_any_log_into_any_tensorboard_directory(data: st.DataObject) -> None:
    fuzz(data, plot=False, tensorboard=True)


@_settings(12)
@given(data=st.data())
def test_any_log_into_any_plot_and_tensorboard(data: st.DataObject) -> None:
    pytest.importorskip("matplotlib")
    fuzz(data, plot=True, tensorboard=True)


@pytest.mark.slow
@_settings(120)
@given(data=st.data())
def test_sweep(data: st.DataObject) -> None:
    fuzz(data, plot=data.draw(st.booleans()), tensorboard=True)


@pytest.mark.parametrize("hostile", HOSTILE_FILES, ids=[p.name for p in HOSTILE_FILES])
@pytest.mark.parametrize("outputs", ["json", "markdown", "plot"])
def test_hostile_fixture_with_every_output(hostile: Path, outputs: str, tmp_path: Path) -> None:
    """Each hostile fixture through every output at once: the plot and TensorBoard export
    beside the JSON, then the markdown (where a value past what an output holds is a note)."""
    if outputs == "plot":
        pytest.importorskip("matplotlib")
    args = {
        "json": ["--json", "--tensorboard", str(tmp_path / "tb"), "--fail-on", "info"],
        "markdown": ["--markdown", "--fail-on", "critical"],
        "plot": ["--plot", str(tmp_path / "p.png"), "--tensorboard", str(tmp_path / "tb")],
    }[outputs]
    case = Case(args=[str(hostile), *args], allowed={"tb", "p.png"})
    result = diagnose(case)
    check(case, result, tmp_path)
    if result.exit_code == 2:  # unreadable: one line on stderr, nothing written
        assert result.stderr.count("\n") == 1, result.stderr
        assert not (tmp_path / "p.png").exists()
