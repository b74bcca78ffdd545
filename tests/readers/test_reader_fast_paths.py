"""The readers' fast paths find exactly what the plain forms they replace would find."""

from __future__ import annotations

import io
import math
import re
from collections.abc import Iterator
from typing import IO

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reader_cases import parse

from stabilizer.core.records import StepRecord
from stabilizer.core.signals import GRAD_NORM, LOSS, LOSS_SCALE, LR, SKIPPED
from stabilizer.replay.readers import (
    Note,
    _fields,
    _lines,
    deepspeed,
    fairseq,
    generic,
    hf_trainer,
    megatron,
    modded_nanogpt,
    nanogpt,
)
from stabilizer.replay.readers._fields import Floats, Scan, line_pattern
from stabilizer.replay.readers._keys import KeyMap
from stabilizer.replay.readers._lines import (
    MAX_LINE,
    RESUME,
    labels,
    pick,
    resume_banner,
    text_chunks,
    text_lines,
)
from stabilizer.replay.readers.base import BaseReader, LogReadError, record
from stabilizer.replay.readers.fairseq import FairseqReader
from stabilizer.replay.readers.generic import GenericReader
from stabilizer.replay.readers.hf_trainer import HfTrainerReader

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
DIGITS = line_pattern(rb"([\t -~]*[0-9][\t -~]*)\r?\n")  # plain lines with a digit
SEVENS = line_pattern(rb"([\t -~]*7[\t -~]*)\r?\n")


def scanned(data: bytes, notes: list[Note], limit: int, switch: bool) -> list[str]:
    """The lines of a `Scan`, rows read back; ``switch``: a new pattern after every list."""
    scan, lines = Scan(io.BytesIO(data), notes, DIGITS, limit), []
    for item in scan:
        if isinstance(item, list):
            lines += item
            if switch:
                scan.pattern = {DIGITS: SEVENS, SEVENS: None, None: DIGITS}[scan.pattern]
        else:
            assert item.rows and item.pattern in (DIGITS, SEVENS)
            for index, (text, rest) in enumerate(item.rows):
                assert rest == b"" and item.line(index) == text.decode()
                lines.append(item.line(index))
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
    matched = [row[0] for item in items if not isinstance(item, list) for row in item.rows]
    assert matched == [b"2", b"4", b"81", b"2", b"4", b"81", b"2", b"4"]
    runs = [len(item.rows) for item in items if not isinstance(item, list)]
    assert runs == [1, 1, 2, 1, 2, 1]  # consecutive matched lines ("8" "1", "2") as one run


def test_floats_memo_is_bounded() -> None:
    floats = Floats()
    for i in range(3 * _fields._MEMO):
        assert floats[f" {i}.5 ".encode()] == i + 0.5
    assert len(floats) <= _fields._MEMO
    with pytest.raises(ValueError):
        floats[b"x"]


# --- generic: the layout fast path reads what the general path reads ----------------------------


class PlainGeneric(BaseReader):
    """`GenericReader` as it was before layouts: every line through `_PAIR` and `KeyMap.rename`."""

    format = "generic"

    def _records(self, stream: IO[bytes]) -> Iterator[StepRecord]:
        keys, last, banner = KeyMap(), -1, ""
        for lineno, line in enumerate(text_lines(stream, self.notes), 1):
            values = keys.rename(generic._PAIR.findall(line))
            found = generic._step(line, values)
            if found is None:
                if last >= 0 and not banner:
                    banner = resume_banner(line)
                continue
            if found < last or banner:
                self.segment(found, last, banner, lineno)
                banner = ""
            last = found
            yield record(found, values)


def read_until_error(reader: BaseReader, data: bytes) -> tuple[list[StepRecord], str]:
    """The records of ``data``, and the error that ended them (``""``: none)."""
    out: list[StepRecord] = []
    try:
        out.extend(reader.read(io.BytesIO(data)))
    except LogReadError as exc:
        return out, str(exc)
    return out, ""


def same_reading(fast: BaseReader, plain: BaseReader, data: bytes) -> None:
    """Both readers give equal records (NaN equal to NaN, keys in the same order), notes and
    errors."""
    (got, error), (want, expected) = read_until_error(fast, data), read_until_error(plain, data)
    assert error == expected
    assert [r.step for r in got] == [r.step for r in want]
    for a, b in zip(got, want, strict=True):
        assert list(a.values) == list(b.values)
        assert all(
            x == y or (math.isnan(x) and math.isnan(y))
            for x, y in zip(a.values.values(), b.values.values(), strict=True)
        )
    assert fast.notes == plain.notes
    assert fast.segment_starts == plain.segment_starts


NAMES = [
    "step", "iter", "global_step", "num_updates", "loss", "train/loss", "lr", "gnorm",
    "grad_2.0_norm/h.0.w", "clip", "finding/x", "tokens/s", "nan", "inf", "é", "loss_step", "a.b-c",
]  # fmt: skip
VALUES = [
    "1", "12", "0", "2.5", "-3", "+4", "1.", ".5", "1e5", "1.5E-3", ".5e3", "1.2.3", "1_0", "nan",
    "NaN", "inf", "-inf", "+Inf", "INF", "Infinity", "1e", "0x1", "12345678901234567", "3.0e-04",
    "٣", "1-2", "7",
]  # fmt: skip
FILLERS = [
    " ", " | ", ", ", "; ", " (", ") ", "] ", "\t", " INFO [train] ", " 12:00:01,5 ", " 45% ",
    " x", "=", ":", "", " é ", " Epoch 3 ", " step ", " iter 5/9 ",
]  # fmt: skip
SEPARATORS = ["=", ": ", ":", " = ", " ="]
NOISE = [
    "Resuming training from checkpoint", "loading checkpoint out/ckpt", " 45%|████▌ | 45/100",
    "", "\x1b[32mINFO\x1b[0m saving", "step 120/5000 loss=2.5", "iter: 7 loss: 2", "UserWarning",
]  # fmt: skip


@st.composite
def templates(draw: st.DrawFn) -> list[tuple[str, str, str]]:
    """A line layout: (filler, name, separator) per pair; values are drawn per line."""
    size = draw(st.integers(1, 5))
    # mostly names and fillers a layout takes
    names = st.sampled_from(NAMES[:8] if draw(st.integers(0, 3)) else NAMES)
    fillers = st.sampled_from(FILLERS[:11] if draw(st.integers(0, 3)) else FILLERS)
    pairs = [(draw(fillers), draw(names), draw(st.sampled_from(SEPARATORS))) for _ in range(size)]
    if draw(st.integers(0, 3)):
        pairs[0] = (pairs[0][0], draw(st.sampled_from(["step", "iter", "global_step"])), "=")
    return pairs


@st.composite
def generic_logs(draw: st.DrawFn) -> str:
    out: list[str] = []
    step = 0
    for _ in range(draw(st.integers(1, 4))):  # blocks, each of one layout
        layout = draw(templates())
        tail = draw(st.sampled_from(["", " ", " done", ",", " é"] if draw(st.booleans()) else [""]))
        for _ in range(draw(st.integers(1, 20))):
            if draw(st.integers(0, 5)) == 0:
                out.append(draw(st.sampled_from(NOISE)))
                continue
            step += 1
            parts = []
            for filler, name, sep in layout:
                value = str(step) if name in ("step", "iter", "global_step") else None
                if value is None or draw(st.integers(0, 9)) == 0:
                    value = draw(st.sampled_from(VALUES) | st.floats().map(str))
                digits = str(draw(st.integers(0, 99999)))
                parts.append(filler.replace("3", digits).replace("5", digits) + name + sep + value)
            if draw(st.integers(0, 9)) == 0:
                step -= draw(st.integers(1, 5))  # a restart
            out.append("".join(parts) + tail)
    return "\n".join(out)


@settings(max_examples=400, deadline=None)
@given(text=generic_logs())
def test_generic_layouts_read_as_the_general_path(text: str) -> None:
    same_reading(GenericReader(), PlainGeneric(), text.encode())


def test_generic_layouts_over_chunks_and_changes() -> None:
    """Layouts changing every few lines, over several chunks; restarts noted on the right lines."""
    lines = []
    for i in range(60_000):
        step = i % 25_000  # two restarts
        if i % 23 < 9:
            lines.append(f"2024-05-01 12:00:{i % 60:02d} INFO step={step} loss={i / 7} lr=3e-4")
        elif i % 23 < 19:
            lines.append(f"Epoch {i // 1000} | iter: {step} | train/loss: {i % 5}.5 | lr: nan")
        elif i % 23 == 19:
            lines.append(f"step={step} loss=1.5.5 x=.5e3 y=1")  # off any layout: 1.5.5, .5e3
        else:
            lines.append("Resuming training from checkpoint" if i % 1000 == 20 else "é noise")
    fast, plain = GenericReader(), PlainGeneric()
    same_reading(fast, plain, "\n".join(lines).encode())
    assert len([n for n in fast.notes if n.kind == "restart"]) > 2


def test_generic_lines_of_a_layout_skip_the_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once learnt, a layout reads its lines (as bytes, a chunk at once): the general path sees
    the lines before it and the others (noise, a value float() refuses) only."""
    general = generic._parse
    seen: list[str] = []

    def counted(line: str, keys: KeyMap) -> tuple[int | None, dict[str, float]]:
        seen.append(line)
        return general(line, keys)

    monkeypatch.setattr(generic, "_parse", counted)
    lines = [f"2024-05-01 12:00:00 INFO step={i} loss={i / 7} lr=3e-4" for i in range(5000)]
    lines[2000] = "\x1b[32mINFO\x1b[0m saving checkpoint"
    lines[3000] = "2024-05-01 12:00:00 INFO step=3000 loss=1.2.3 lr=3e-4"  # loss: no number
    reader = GenericReader()
    records = list(reader.read(io.BytesIO("".join(f"{line}\n" for line in lines).encode())))
    assert len(records) == 4999 and records[-1].values == {"loss": 4999 / 7, "lr": 3e-4}
    assert seen == [lines[0], "INFO saving checkpoint", lines[3000]]


# --- hf_trainer: whole-chunk matching of the usual dict reads what the per-line path reads -------


class PlainHf(HfTrainerReader):
    """`HfTrainerReader` as it was before whole-chunk matching: `_usual` and `_any` per line."""

    def _records(self, stream: IO[bytes]) -> Iterator[StepRecord]:
        keys, hidden = KeyMap(), hf_trainer.HiddenNan(self)
        count, last, banner = 0, -1, ""
        for lineno, line in enumerate(text_lines(stream, self.notes), 1):
            start = line.find("{'")
            values = None if start < 0 else hf_trainer._usual(line, start)
            if values is not None:
                count += 1
                step = count
            elif start < 0 or hf_trainer._DICT.match(line, start) is None:
                if last >= 0 and not banner:
                    banner = resume_banner(line)
                continue
            elif (parsed := hf_trainer._any(line, start, keys)) is None:
                continue
            else:
                values, counted, logged = parsed
                count += counted
                step = count if logged is None else logged
            if step < last or banner or step == 1 == count:
                banner = self._mark(step, last, banner, lineno, count)
            last = step
            hidden.check(step, values, lineno)
            yield record(step, values)


HF_VALUES = ["2.5", "0", "nan", "inf", "-1e-05", "x", "'eval_", "tensor(0.9)", "1_0", " 3", "é"]
HF_LINES = [
    "{{'loss': {}, 'grad_norm': {}, 'learning_rate': {}, 'epoch': {}}}",
    " 10%|█ | 5/50 [00:01<00:09]{{'loss': {}, 'grad_norm': {}, 'learning_rate': {}, 'epoch': {}}}",
    "{{'loss': {}, 'grad_norm': {}, 'learning_rate': {}, 'epoch': {}}} ",
    "{{'eval_loss': {}, 'eval_runtime': {}, 'epoch': {}, 'step': {}}}",
    "{{'loss': {}, 'learning_rate': {}, 'epoch': {}, 'step': {}}}",
    "{{'train_runtime': {}, 'train_loss': {}, 'epoch': {}{}}}",
    "Resuming training from checkpoint {}{}{}{}",
    "noise {}{}{}{}",
]


@settings(max_examples=300, deadline=None)
@given(
    lines=st.lists(
        st.tuples(
            st.sampled_from(HF_LINES),
            st.lists(
                st.sampled_from(HF_VALUES) | st.floats().map(str) | st.integers(0, 9).map(str),
                min_size=4,
                max_size=4,
            ),
        ),
        max_size=40,
    )
)
def test_hf_usual_lines_read_as_per_line(lines: list[tuple[str, list[str]]]) -> None:
    text = "\n".join(line.format(*values) for line, values in lines)
    same_reading(HfTrainerReader(), PlainHf(), text.encode())


# --- fairseq: usual lines matched as bytes read as the per-line path ------------------------------


class PlainFairseq(FairseqReader):
    """`FairseqReader` as it was before `Scan`: every line through `_usual` or `_parsed`."""

    def _records(self, stream: IO[bytes]) -> Iterator[StepRecord]:
        last, banner, noted = -1, "", False
        for lineno, line in enumerate(text_lines(stream, self.notes), 1):
            step, values = fairseq._usual(line) or fairseq._parsed(line)
            if step is None:
                if values:
                    yield self._overflow(max(last, 0) + 1, values, lineno)
                elif last >= 0 and not banner:
                    banner = resume_banner(line)
                continue
            if step < last or banner:
                self.segment(step, last, banner, lineno)
                banner = ""
            if not noted and LOSS in values:
                noted = self._note_bits(lineno)
            last = step
            yield record(step, values)


FAIRSEQ_LINE = (
    "{}2024-01-01 12:00:00 | INFO | train_inner | epoch 001:  {} / 2000 loss={}, nll_loss={}, "
    "ppl={}, wps=31234.5, ups=3.12, wpb=10012.3, bsz=128, num_updates={}, lr={}, gnorm={}, "
    "clip={}, loss_scale={}{}"
)
FAIRSEQ_VALUES = [
    "2.5", "0", "12", "nan", "inf", "-1e-05", "x", "1=2", "1,2", "é", " 3", "1_0", "7", "0005",
    "5 num_updates=99", "5 lr=1",
]  # fmt: skip
FAIRSEQ_EDGES = ["", "Resuming from checkpoint ", "é", "| ", "\x1b[32m", "a=b ", ", train_wall=3"]
FAIRSEQ_OTHER = [
    "2024-01-01 12:00:00 | INFO | fairseq.trainer | NOTE: gradient overflow detected, ignoring "
    "gradient, setting loss scale to: 32.0",
    "2024-01-01 12:00:00 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 8.5 | "
    "num_updates 12",
    "Resuming training from checkpoint checkpoints/checkpoint_last.pt",
    " 45%|████▌ | 45/100",
    "",
]


@st.composite
def fairseq_logs(draw: st.DrawFn) -> str:
    lines = []
    for _ in range(draw(st.integers(0, 30))):
        if draw(st.integers(0, 3)):
            texts = draw(st.lists(st.sampled_from(FAIRSEQ_VALUES), min_size=9, max_size=9))
            edges = draw(st.lists(st.sampled_from(FAIRSEQ_EDGES), min_size=2, max_size=2))
            lines.append(FAIRSEQ_LINE.format(edges[0], *texts, edges[1]))
        else:
            lines.append(draw(st.sampled_from(FAIRSEQ_OTHER)))
    ending = draw(st.sampled_from(["\n", "\r\n"]))
    return ending.join(lines) + draw(st.sampled_from(["", ending]))


@settings(max_examples=400, deadline=None)
@given(text=fairseq_logs())
def test_fairseq_usual_lines_read_as_per_line(text: str) -> None:
    same_reading(FairseqReader(), PlainFairseq(), text.encode())


def test_fairseq_usual_lines_take_the_fast_path() -> None:
    usual = FAIRSEQ_LINE.format("", "1", "9.1", "9.0", "512", "7", "5e-4", "1.2", "0", "128", "")
    data = (usual + "\n" + usual.replace("num_updates=7", "num_updates=8") + "\n") * 2
    items = list(fairseq.Scan(io.BytesIO(data.encode()), [], fairseq._USUAL_BYTES))
    assert sum(len(item.rows) for item in items if not isinstance(item, list)) == 3  # the body
    same_reading(FairseqReader(), PlainFairseq(), data.encode())
    fake = usual.replace("ppl=512", "ppl=5 num_updates=99")  # the general way reads 99
    same_reading(FairseqReader(), PlainFairseq(), f"{fake}\n{fake}\n{fake}\n".encode())
    odd = usual.replace("loss_scale=128", "loss_scale=1=2")  # no number: no loss scale
    same_reading(FairseqReader(), PlainFairseq(), f"{odd}\n{odd}\n{odd}\n".encode())
    banner = "Resuming from checkpoint " + usual.replace("num_updates=7", "num_updates=nan")
    lines = f"{usual}\n{usual}\n{banner}\n{usual}\n{usual}\n"  # no record, but a banner
    same_reading(FairseqReader(), PlainFairseq(), lines.encode())


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from([b"\x1b", b"]", b"[", b"a", b"\x1b]", b"\n"]), max_size=200))
def test_osc_test_is_the_two_byte_search(pieces: list[bytes]) -> None:
    data = b"".join(pieces)
    assert _fields._osc(data) == (b"\x1b]" in data)


@st.composite
def fairseq_runs(draw: st.DrawFn) -> str:
    """Mostly usual lines with numbers and updates going on (runs read at once), some odd."""
    lines, update = [], 0
    for _ in range(draw(st.integers(0, 60))):
        if draw(st.integers(0, 7)) == 0:
            lines.append(draw(st.sampled_from(FAIRSEQ_OTHER)))
            continue
        update += draw(st.sampled_from([1, 1, 1, 0, -3]))
        texts = ["1", "9.1", "9.0", "512", str(update), "5e-4", "1.2", "0", "128"]
        if draw(st.integers(0, 4)) == 0:  # an odd value
            texts[draw(st.integers(0, 8))] = draw(st.sampled_from([*FAIRSEQ_VALUES, "1e400"]))
        edges = draw(st.sampled_from([["", ""], ["", ", train_wall=3"], ["é", ""]]))
        lines.append(FAIRSEQ_LINE.format(edges[0], *texts, edges[1]))
    ending = draw(st.sampled_from(["\n", "\r\n"]))
    return ending.join(lines) + draw(st.sampled_from(["", ending]))


@settings(max_examples=300, deadline=None)
@given(text=fairseq_runs(), chunk=st.sampled_from([64, 700, 4096, 1 << 20]))
def test_fairseq_runs_read_as_per_line(text: str, chunk: int) -> None:
    with pytest.MonkeyPatch.context() as patch:  # small chunks: runs cut at chunk boundaries
        patch.setattr(_lines, "CHUNK", chunk)
        same_reading(FairseqReader(), PlainFairseq(), text.encode())


def test_fairseq_usual_runs_go_at_once() -> None:
    """Runs of usual lines become records at once, not line by line (the fast path is taken)."""
    usual = FAIRSEQ_LINE.format("", "1", "9.1", "9.0", "512", "{}", "5e-4", "1.2", "0", "128", "")
    data = "\n".join(usual.format(update) for update in range(1, 3001)).encode() + b"\n"
    at_once, one_by_one = [], []
    with pytest.MonkeyPatch.context() as patch:
        batch, read = fairseq._batch, fairseq._read
        patch.setattr(fairseq, "_batch", lambda *a: at_once.append(1) or batch(*a))
        patch.setattr(fairseq, "_read", lambda item: one_by_one.append(item) or read(item))
        same_reading(FairseqReader(), PlainFairseq(), data)
    assert at_once and len(one_by_one) <= 2  # the first chunk's first line and last lines
