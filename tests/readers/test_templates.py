"""A line read by a learnt template reads exactly as the full path reads it (`universal.templates`).

Each test reads the same lines twice with the universal reader: as it reads them (a record line
whose template it has learnt is read by one match) and with the templates switched off (every
line through the full path), and wants the same items, in the same order, with the same values
(NaN and key order included); and it checks that templates did read lines, so that the
comparison is not between two full paths.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stabilizer.replay.readers._lines import text_lines
from stabilizer.replay.readers.universal import UniversalReader
from stabilizer.replay.readers.universal.templates import MAX_TEMPLATES, Read, Templates

ROOT = Path(__file__).resolve().parents[2]
REAL = [ROOT / "tests" / "fixtures" / "real" / "logs", ROOT.parent / "shared" / "reallogs" / "logs"]

Both = Callable[[list[str]], tuple[list[str], list[str], int]]


@pytest.fixture
def both(monkeypatch: pytest.MonkeyPatch) -> Iterator[Both]:
    """Reads lines both ways: returns (as read, as the full path reads them, lines templates
    read)."""
    original = Templates.read
    hits = [0]

    def counted(self: Templates, line: str) -> Read | None:
        found = original(self, line)
        hits[0] += found is not None
        return found

    def read(lines: list[str]) -> tuple[list[str], list[str], int]:
        hits[0] = 0
        with monkeypatch.context() as patch:
            patch.setattr(Templates, "read", counted)
            fast = [repr(item) for item in UniversalReader().read_lines(lines)]
        with monkeypatch.context() as patch:
            patch.setattr(Templates, "read", lambda self, line: None)
            full = [repr(item) for item in UniversalReader().read_lines(lines)]
        return fast, full, hits[0]

    yield read


TEMPLATE = [
    f"iter {step}: loss {2.5 - step / 100:.4f}, time 51{step % 10}.34ms" for step in range(8)
]

LOOKALIKES: dict[str, list[str]] = {
    # fields added or dropped: the template no longer matches the whole line
    "a field more": ["iter 8: loss 2.4100, time 512.34ms, mfu 30.12%"],
    "a field fewer": ["iter 8: loss 2.4100"],
    # values no template's digits match
    "NaN": ["iter 8: loss nan, time 512.34ms", "iter 9: loss NaN, time 512.34ms"],
    "nan with letters": ["iter 8: loss nanxxx, time 512.34ms"],
    "inf": ["iter 8: loss inf, time 512.34ms", "iter 9: loss -Infinity, time 512.34ms"],
    "an exponent": ["iter 8: loss 2.41e+00, time 512.34ms", "iter 9: loss 1E-3, time 512.34ms"],
    "a sign": ["iter 8: loss -2.4100, time 512.34ms"],
    "no decimals": ["iter 8: loss 2, time 512.34ms", "iter 9: loss 2., time 512.34ms"],
    "thousands": ["iter 8: loss 1,234.5, time 512.34ms", "iter 9: loss 0,123, time 5,123ms"],
    "other digits": ["iter ٨: loss 2.4100, time 512.34ms", "iter 9: loss ٢.4100, time 512.34ms"],
    # the step
    "a reset": ["iter 0: loss 2.5000, time 510.34ms", "iter 1: loss 2.4900, time 511.34ms"],
    "a step that goes back": ["iter 3: loss 2.4700, time 513.34ms"],
    "the same step again": ["iter 7: loss 2.3000, time 517.34ms"],
    "a huge step": [f"iter {10**30}: loss 2.4100, time 512.34ms"],
    "an epoch": ["epoch 2 iter 8: loss 2.4100, time 512.34ms", "iter 9: loss 2.4, time 5.34ms"],
    # what the words around the numbers say
    "an evaluation": ["iter 8: val loss 2.4100, time 512.34ms"],
    "a resume banner": ["Resuming training from checkpoint out/ckpt.pt"],
    "an overflow": ["iter 8: loss 2.4100, time 512.34ms overflow, reducing loss scale to 1024"],
    "a loss scale": [
        f"iter {s}: loss 2.41, time 5.3ms, loss scale: {2**s}.0" for s in range(8, 12)
    ],
    "another template": [f"step {s} | loss {s / 7:.3f} | lr 3.0e-04" for s in range(8, 14)],
}


@pytest.mark.parametrize("name", LOOKALIKES)
def test_a_line_like_the_template_reads_as_the_full_path_reads_it(name: str, both: Both) -> None:
    lines = [*TEMPLATE, *LOOKALIKES[name], *TEMPLATE[3:]]
    fast, full, hits = both(lines)
    assert fast == full
    assert hits >= 5  # (the template read the lines after the first)


CASES: dict[str, tuple[list[str], int, tuple[int, str]]] = {
    # ``top1`` and ``top5`` are two names: a template keeps a name's digits as printed
    "digits in a name": (
        [f"step {s} top1 0.{s}1 loss 2.{s}" for s in range(1, 6)]
        + [f"step {s} top5 0.{s}1 loss 2.{s}" for s in range(6, 9)]
        + [f"step {s} grad_norm/layer.{s % 3}.weight: 0.5 loss 2.0" for s in range(9, 15)],
        8,
        (5, "'top5': 0.61"),
    ),
    # ``loss: 9,876`` is 9876 and ``loss: 0,234`` is 0 (no thousands after a 0): the runs of a
    # number with separators, where a value may start, are the template's own; a time's
    # milliseconds (``12:00:01,123``: no value starts there) are any digits
    "thousands where a value starts": (
        [f"step: {s}, loss: 2.{s}, 12:00:0{s},{s}23 done" for s in range(1, 6)]
        + [f"step: {s}, loss: 0,234, 12:00:0{s},{s}23 done" for s in range(6, 9)]
        + ["step: 9, loss: 9,876, 12:00:09,923 done", "step: 10, loss: 0,567, 12:00:10,023 done"]
        + ["step: 11, loss: 0,234, 12:00:11,123 done", "step: 12, loss: 2.5, 12:00:12,1 done"],
        6,
        (8, "'loss': 9876.0"),
    ),
    # a count ``n/N`` within an epoch counts on from the epochs before (no template); a line
    # that names only its epoch, below the steps a template read, has no step of its own (the
    # reader knows the last step the templates read)
    "a count within an epoch, an epoch below the steps": (
        [f"Epoch {e} step {n}/100 loss {n / 7:.4f}" for e in (1, 2, 3) for n in range(1, 6)]
        + [f"step {s} loss {s / 7:.4f}" for s in range(300, 310)]
        + ["| epoch 305 | valid on 'valid' subset | valid_loss 1.5", "step 310 loss 1.0"],
        8,
        (7, "step=103"),
    ),
    # two counters (the step, and the other in ``where``), a bar's count, llm.c's ``s:``
    "several counters and a bar": (
        [f"iter {s} step {s // 2} loss {s}.5 lr 1e-4" for s in range(1, 9)]
        + [f"s:{s} trl:{9 - s / 10:.2f} norm:3.01" for s in range(1, 9)]
        + [f"step {s}/100 [00:0{s}<01:00] loss={s}.25" for s in range(1, 9)],
        15,
        (0, "step=0"),
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_a_case_reads_as_the_full_path_reads_it(name: str, both: Both) -> None:
    lines, least, (at, text) = CASES[name]
    fast, full, hits = both(lines)
    assert fast == full
    assert hits >= least
    assert text in fast[at]


def test_more_templates_than_kept(both: Both) -> None:
    """Templates past `MAX_TEMPLATES` push the least recent out; the lines read the same."""
    lines = [
        f"step {s} metric{k}_x {s} loss {s}.5" for k in range(MAX_TEMPLATES + 4) for s in (1, 2)
    ]
    lines *= 2
    fast, full, hits = both(lines)
    assert fast == full
    assert hits >= MAX_TEMPLATES


def test_every_real_log_reads_the_same(both: Both) -> None:
    """Every real log, every line through the universal reader (whatever reader detection
    picks for it), read the same with templates and without."""
    read = 0
    logs = sorted(path for folder in REAL if folder.is_dir() for path in folder.iterdir())
    assert len(logs) > 200
    for path in logs:
        with path.open("rb") as stream:
            lines = list(text_lines(stream, []))
        fast, full, hits = both(lines)
        assert fast == full, path.name
        read += hits
    assert read > 5000


NAMES = ["loss", "lr", "grad_norm", "top1", "val loss", "total", "Losses", "acc", "epoch", "s"]
SEPARATORS = [": ", "=", " ", " is ", ":", "': "]
COUNTERS = ["step", "iter", "Step", "global_step", "iteration", "s:"]
NUMBERS = st.one_of(
    st.integers(0, 10**6).map(str),
    st.floats(0, 1e4, allow_nan=False).map(lambda x: f"{x:.4f}"),
    st.floats(-1e4, 1e4, allow_nan=False).map(lambda x: f"{x:.3e}"),
    st.integers(1000, 10**7).map(lambda x: f"{x:,}"),
    st.sampled_from(["nan", "inf", "-inf", "NaN", ".5", "5.", "0,123", "1,23", "007"]),
)


@st.composite
def logs(draw: st.DrawFn) -> list[str]:
    """Lines of one to three templates, each number drawn anew a line: a template's numbers in
    every shape (digits of any count, signs, exponents, NaN, thousands)."""
    shapes = []
    for _ in range(draw(st.integers(1, 3))):
        fields = draw(st.lists(st.tuples(st.sampled_from(NAMES), st.sampled_from(SEPARATORS))))
        shapes.append((draw(st.sampled_from(COUNTERS)), fields[:4], draw(st.sampled_from(", |"))))
    lines = []
    for _ in range(draw(st.integers(1, 40))):
        counter, fields, joint = draw(st.sampled_from(shapes))
        parts = [f"{counter} {draw(st.integers(0, 10**5))}"]
        parts += [f"{name}{sep}{draw(NUMBERS)}" for name, sep in fields]
        lines.append(joint.join(parts))
    return lines


@given(lines=logs())
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
def test_any_lines_read_the_same(lines: list[str], both: Both) -> None:
    fast, full, _ = both(lines)
    assert fast == full
