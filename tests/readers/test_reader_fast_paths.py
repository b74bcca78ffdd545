"""The readers' fast paths find exactly what the plain forms they replace would find."""

from __future__ import annotations

import io
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reader_cases import parse

from stabilizer.readers import (
    Note,
    _fields,
    _lines,
    deepspeed,
    generic,
    megatron,
    modded_nanogpt,
    nanogpt,
)
from stabilizer.readers._fields import Floats, Scan
from stabilizer.readers._lines import MAX_LINE, RESUME, labels, pick, resume_banner, text_chunks
from stabilizer.signals import GRAD_NORM, LOSS, LOSS_SCALE, LR, SKIPPED

NUMBER = r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))"
PLAIN = {  # the fast pattern → the plain one (``\bword`` first: no fast literal scan)
    nanogpt._ITER: r"\biter (\d+): loss " + NUMBER,
    nanogpt._EVAL: r"\bstep (\d+): train loss " + NUMBER + r", val loss " + NUMBER,
    modded_nanogpt._STEP: r"\bstep:(\d+)/\d+ (train_loss|val_loss):" + NUMBER,
    megatron._ITERATION: r"\biteration\s+(\d+)\s*/\s*\d+\s*\|",
    deepspeed._PROGRESS: r"\bstep=(\d+), skipped=(\d+), lr=\[?" + NUMBER,
    deepspeed._LOSS: r"\bsteps: (\d+) loss: " + NUMBER,
    generic._PAIR: r"(?<![\w./-])([A-Za-z_][\w./-]*) ?[:=] ?"
    r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+|nan|inf|NaN|Inf))(?=[\s,;|)\]]|$)",
}
PIECES = [
    "iter 12: loss 2.5", "step 3: train loss 1, val loss 2", "step:4/9 train_loss:nan",
    " iteration   5/ 10 |", "step=7, skipped=0, lr=[0.1]", "steps: 8 loss: 3", "lr=3e-4",
    "a.b/c-d: .5", "x", "é", "_", "9", " ", ",", "|", "=", ":", "]", "-", "e", "nan", "\t", "ſ",
]  # fmt: skip
text = st.lists(st.sampled_from(PIECES) | st.text(max_size=3), max_size=12).map("".join)


def found(match: re.Match[str] | None) -> object:
    return None if match is None else (match.span(), match.groups())


@settings(max_examples=300, deadline=None)
@given(line=text)
def test_patterns_match_as_their_plain_forms(line: str) -> None:
    for fast, plain in PLAIN.items():
        assert found(fast.search(line)) == found(re.compile(plain).search(line)), fast.pattern
    assert generic._PAIR.findall(line) == re.findall(PLAIN[generic._PAIR], line)
    if line.isascii():
        assert generic._PAIR_ASCII.findall(line) == generic._PAIR.findall(line)


FIELDS = labels(
    {
        "| lm loss:": LOSS,
        "| loss scale:": LOSS_SCALE,
        "| grad norm:": GRAD_NORM,
        "| learning rate:": LR,
        "| number of skipped iterations:": "skipped_iterations",
        "| number of nan iterations:": "nan_iterations",
    }
)
MEGATRON = [
    " | learning rate: 3.0E-04", " | lm loss: 2.5", " | loss scale: 4096.0", " | grad norm: 0.5",
    " | number of skipped iterations:   1", " | number of nan iterations:   0", " | lm loss: x",
    " | consumed samples: 512", " |", "| lm loss: nan", " | number of nan iterations: 2",
]  # fmt: skip


def picked(line: str) -> dict[str, float]:
    """What `megatron._values` did before its fast path: `pick` each label."""
    values = pick(line, 0, FIELDS, "|")
    if values.get("nan_iterations", 0.0) > 0:
        values[LOSS] = math.nan
    if "skipped_iterations" in values:
        values[SKIPPED] = 1.0 if values["skipped_iterations"] > 0 else 0.0
    return values


@settings(max_examples=300, deadline=None)
@given(fields=st.lists(st.sampled_from(MEGATRON), max_size=9), usual=st.booleans())
def test_megatron_values_as_picked(fields: list[str], usual: bool) -> None:
    line = "".join([*MEGATRON[:6], " |"] if usual else fields)
    fast, slow = megatron._values(line, 0), picked(line)
    assert list(fast) == list(slow)
    assert all(
        a == b or (math.isnan(a) and math.isnan(b))
        for a, b in zip(fast.values(), slow.values(), strict=True)
    )


@settings(max_examples=300, deadline=None)
@given(
    line=st.lists(
        st.sampled_from(
            [
                "Resum",
                "ing",
                " training",
                "LOAD",
                "ed checkpoint",
                "ſ",
                "restor",
                "ing states from",
                "continuing",
                " from",
                "x",
                "İ",
            ]
        ),
        max_size=6,
    ).map("".join)
)
def test_resume_banner_as_the_regex(line: str) -> None:
    assert resume_banner(line) == (line.strip()[:80] if RESUME.search(line) else "")


def test_csv_header_changing_within_a_step_merges_by_name() -> None:
    """Cells go straight to signal keys under one header; a new header mid-step goes by name."""
    text = "step,train_loss_step,lr-AdamW\n1,2.0,0.1\nstep,loss\n1,3.0\n2,4.0\nstep,loss\n3,5.0\n"
    assert [(r.step, r.values) for r in parse("lightning_csv", text)] == [
        (1, {"loss": 3.0, "lr": 0.1}),
        (2, {"loss": 4.0}),
        (3, {"loss": 5.0}),
    ]


# --- `Scan`: text_chunks' lines, plain lines matched as bytes -------------------------------------

BYTES = [
    b"a", b"7", b" 12 ", b"\n", b"\n", b"7\n", b"\r", b"\r\n", b"\t", b"x" * 30, b"\x1b[31m",
    b"\x1b", b"]", b"\x1b]0;t\x07", b"\x07", b"\xe2\x96\x88", b"\xc2\x85", b"\xe2\x80\xa8", b"\xff",
    b"\xe2", b"\x0b", b"\x1c", b"\x1f", b"\xef\xbb\xbf",
]  # fmt: skip
DIGITS = re.compile(rb"^[\t -~]*[0-9][\t -~]*\r?\n", re.MULTILINE)  # plain lines with a digit
SEVENS = re.compile(rb"^[\t -~]*7[\t -~]*\r?\n", re.MULTILINE)


def scanned(data: bytes, notes: list[Note], limit: int, switch: bool) -> list[str]:
    """The lines of a `Scan`, matches decoded; ``switch``: a new pattern after every list."""
    scan, lines = Scan(io.BytesIO(data), notes, DIGITS, limit), []
    for item in scan:
        if isinstance(item, list):
            lines += item
            if switch:
                scan.pattern = {DIGITS: SEVENS, SEVENS: None, None: DIGITS}[scan.pattern]
        else:
            assert item.end() == len(item.string) or item.string[item.end() - 1] == 10
            lines.append(item[0].decode().rstrip("\r\n"))
    return lines


@settings(max_examples=400, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(BYTES), max_size=60),
    start=st.sampled_from([b"", b"\xef\xbb\xbf", b"\xff\xfe"]),
    chunk=st.sampled_from([1, 2, 5, 16, 64, 4096]),
    limit=st.sampled_from([1, 4, 10, 100, MAX_LINE]),
    switch=st.booleans(),
)
def test_scan_gives_the_lines_of_text_chunks(
    pieces: list[bytes], start: bytes, chunk: int, limit: int, switch: bool
) -> None:
    data = start + b"".join(pieces)
    with pytest.MonkeyPatch.context() as patch:  # small chunks: many chunk boundaries
        patch.setattr(_lines, "CHUNK", chunk)
        plain: list[Note] = []
        expected = [line for lines in text_chunks(io.BytesIO(data), plain, limit) for line in lines]
        notes: list[Note] = []
        assert scanned(data, notes, limit, switch) == expected
        assert notes == plain


def test_scan_matches_plain_lines_only() -> None:
    data = b"1\n2\n\x1b[0m3\n4\r\n\xe2\x96\x88 5\n6\r7\n8"
    items = list(Scan(io.BytesIO(data * 3), [], DIGITS))
    matched = [item[0] for item in items if not isinstance(item, list)]
    assert matched == [b"2\n", b"4\r\n", b"81\n", b"2\n", b"4\r\n", b"81\n", b"2\n", b"4\r\n"]


def test_floats_memo_is_bounded() -> None:
    floats = Floats()
    for i in range(3 * _fields._MEMO):
        assert floats[f" {i}.5 ".encode()] == i + 0.5
    assert len(floats) <= _fields._MEMO
    with pytest.raises(ValueError):
        floats[b"x"]
