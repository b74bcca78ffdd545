"""`MegatronReader`: both layouts, interval averages, NaN averages left off the line."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reader_cases import findings, kinds, parse, records, serious

from stabilizer.core.records import StepRecord
from stabilizer.replay.readers import Note, _lines, megatron

OLD = (
    " iteration      100/   50000 | consumed samples:        51200 | elapsed time per iteration "
    "(ms): 1234.5 | learning rate: 3.000E-04 | global batch size:   512 | lm loss: 3.141593E+00 | "
    "loss scale: 4096.0 | grad norm: 0.500 | number of skipped iterations:   0 | "
    "number of nan iterations:   0 |"
)
NEW_NAN = (
    "[2024-05-01 12:00:00] iteration      200/   50000 | consumed samples:       102400 | "
    "elapsed time per iteration (ms): 1234.5 | throughput per GPU (TFLOP/s/GPU): 180.3 | "
    "learning rate: 3.000000E-04 | global batch size:   512 | loss scale: 2048.0 | "
    "number of skipped iterations:   3 | number of nan iterations:   2 |"
)


def test_old_and_new_layouts_and_nan_interval() -> None:
    notes: list[Note] = []
    good, bad = parse("megatron", f"{OLD}\ntime (ms) | forward-compute: 400.1\n{NEW_NAN}\n", notes)
    assert good.step == 100 and good.values == {
        "lr": 3e-4, "loss": 3.141593, "loss_scale": 4096.0, "grad_norm": 0.5,
        "skipped_iterations": 0.0, "nan_iterations": 0.0, "skipped": 0.0,
    }  # fmt: skip
    assert bad.step == 200 and math.isnan(bad.values["loss"]) and bad.values["skipped"] == 1.0
    assert "grad_norm" not in bad.values
    assert [(n.kind, n.line) for n in notes] == [("format", 3)]
    assert "averages over the log interval of 100 iterations" in notes[0].message


def test_healthy_fixture() -> None:
    recs = records("megatron_healthy.log")
    assert [r.step for r in recs[:3]] == [10, 20, 30] and len(recs) == 200
    assert recs[0].values["loss_scale"] == 131072.0 and recs[30].values["skipped"] == 1.0
    assert not serious(findings(recs))


def test_failing_fixture() -> None:
    recs = records("megatron_failing.log")
    assert all(math.isnan(r.values["loss"]) for r in recs[150:])
    assert kinds(findings(recs)) == {"nonfinite_loss", "fp16_overflow"}


def test_resume_banner_starts_a_segment() -> None:
    notes: list[Note] = []
    text = f"{OLD}\n loading checkpoint from /ckpt at iteration 100\n{OLD}\n"
    assert len(parse("megatron", text, notes)) == 2
    assert [n.kind for n in notes] == ["restart"]
    assert "loading checkpoint" in notes[0].message and notes[0].line == 3


# --- the fast path (a learned layout matched over bytes) reads what the general way reads ---------

FIELDS = [
    "learning rate", "lm loss", "loss scale", "grad norm", "number of skipped iterations",
    "number of nan iterations", "consumed samples", "global batch size",
    "elapsed time per iteration (ms)", "lm loss scale",
]  # fmt: skip
VALUES = [" 3.000E-04 ", " 2.5 ", "   0 ", "   2 ", " nan ", " inf ", " -inf ", " x ", "", " 1_0 "]
NOISE = [
    "time (ms) | forward-compute: 400.1", " loading checkpoint from /ckpt at iteration 100",
    "\x1b[32mINFO\x1b[0m saving", " 45%|████▌     | 4500/10000", "a\rb", "", "iteration",
    "[2024-05-01 12:00:00] iteration 7/ 9 |", " iteration 3/ 9 | lm loss: 1.5 | lm loss: 2 |",
]  # fmt: skip


def general(text: str, notes: list[Note]) -> list[StepRecord]:
    """What the reader reads without its fast path (no layout is ever learned)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(megatron._Layout, "of", staticmethod(lambda line: None))
        return parse("megatron", text, notes)


def same(a: list[StepRecord], b: list[StepRecord]) -> bool:
    return [(r.step, list(r.values), [repr(v) for v in r.values.values()]) for r in a] == [
        (r.step, list(r.values), [repr(v) for v in r.values.values()]) for r in b
    ]


layouts = st.lists(st.sampled_from(FIELDS), min_size=1, max_size=9)
lines = st.one_of(
    st.tuples(
        st.integers(0, 1), st.integers(0, 300), st.lists(st.sampled_from(VALUES), max_size=9)
    ),
    st.sampled_from(NOISE),
)


@settings(max_examples=150, deadline=None)
@given(
    two=st.tuples(layouts, layouts),
    prefix=st.sampled_from([" ", "[2024-05-01 12:00:00] ", "", "Xi "]),
    items=st.lists(lines, max_size=40),
    end=st.sampled_from(["\n", "\r\n", " |\n"]),
)
def test_fast_path_reads_as_the_general_way(
    two: tuple[list[str], list[str]], prefix: str, items: list[object], end: str
) -> None:
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(item)
            continue
        which, step, values = item  # type: ignore[misc]
        fields = "".join(
            f"| {label}:{value}" for label, value in zip(two[which], values * 9, strict=False)
        )
        out.append(f"{prefix}iteration {step:8d}/   50000 {fields}")
    text = end.join(out) + end
    fast_notes: list[Note] = []
    slow_notes: list[Note] = []
    assert same(parse("megatron", text, fast_notes), general(text, slow_notes))
    assert fast_notes == slow_notes


def test_fast_path_layout_change_restarts_and_nan() -> None:
    usual = OLD.replace("      100/", "{step:8d}/")
    nan_line = NEW_NAN.replace("      200/", "{step:8d}/")
    lines = [usual.format(step=s) for s in (10, 20, 30)]
    lines += [nan_line.format(step=s) for s in (40, 50)]  # another layout: no loss, no grad norm
    lines += [" loading checkpoint from /ckpt", usual.format(step=30), usual.format(step=40)]
    lines += [usual.format(step=20).replace("3.141593E+00", "nan")]  # the step goes back
    lines += [usual.format(step=30).replace("0.500", "inf")]
    text = "\n".join(lines * 300) + "\n"  # several chunks of the fast path
    notes: list[Note] = []
    slow_notes: list[Note] = []
    calls = []
    with pytest.MonkeyPatch.context() as patch:  # count the lines read the general way
        general_way = megatron._step_values
        patch.setattr(
            megatron, "_step_values", lambda line: calls.append(line) or general_way(line)
        )
        fast = parse("megatron", text, notes)
    assert len(calls) == 1 + 3 * 300  # the first line; per round: two layout changes, a banner
    assert same(fast, general(text, slow_notes)) and notes == slow_notes
    assert [n.line for n in notes[:4]] == [2, 7, 9, 11]
    assert notes[1].message.startswith("restart: resume banner") and notes[1].step == 30
    assert "went back from 40 to 20" in notes[2].message
    assert math.isnan(fast[7].values["loss"]) and fast[8].values["grad_norm"] == math.inf


# --- runs of usual lines converted at once (`_Layout.batch`) read as the general way ------------

RUN_VALUES = [
    " 2.5 ", " 3.000E-04 ", "   0 ", "   1 ", " nan ", " 1e400 ", " -inf ", " x ", "", " = ",
    " 1_0 ", " 1,5 ", " 7 ",
]  # fmt: skip
RUN_NOISE = [
    " loading checkpoint from /ckpt at iteration 100", "time (ms) | forward-compute: 400.1",
    "\x1b[32mINFO\x1b[0m saving", " 45%|████▌     | 4500/10000", "", "a\rb",
]  # fmt: skip


@st.composite
def megatron_runs(draw: st.DrawFn) -> bytes:
    """Usual lines (mostly numbers, steps mostly going on), some of another layout, noise."""
    out, step = [], 0
    for _ in range(draw(st.integers(0, 60))):
        kind = draw(st.integers(0, 9))
        if kind == 0:
            out.append(draw(st.sampled_from(RUN_NOISE)))
            continue
        step += draw(st.sampled_from([10, 10, 10, 0, -20, 1]))
        line = (OLD if kind > 1 else NEW_NAN).replace("      100/", f"{max(step, 0):9d}/")
        line = line.replace("      200/", f"{max(step, 0):9d}/")
        if draw(st.integers(0, 4)) == 0:  # an odd value (of a label on the line)
            label = draw(st.sampled_from(["lm loss:", "grad norm:", "loss scale:", "rate:"]))
            value = draw(st.sampled_from(RUN_VALUES))
            at = line.find(label) + len(label) if label in line else line.index(":") + 1
            line = line[:at] + value + line[line.index("|", at) :]
        if draw(st.integers(0, 9)) == 0:
            line = line.rstrip(" |")  # no "|" at its end
        out.append(line)
    ending = draw(st.sampled_from(["\n", "\r\n"]))
    return (ending.join(out) + draw(st.sampled_from(["", ending]))).encode()


@settings(max_examples=300, deadline=None)
@given(data=megatron_runs(), chunk=st.sampled_from([64, 700, 4096, 1 << 20]))
def test_runs_read_as_the_general_way(data: bytes, chunk: int) -> None:
    with pytest.MonkeyPatch.context() as patch:  # small chunks: runs cut at chunk boundaries
        patch.setattr(_lines, "CHUNK", chunk)
        fast_notes: list[Note] = []
        slow_notes: list[Note] = []
        assert same(parse("megatron", data, fast_notes), general(data.decode(), slow_notes))
        assert fast_notes == slow_notes


def test_usual_runs_go_at_once() -> None:
    """Runs of usual lines become records at once, not line by line (the fast path is taken)."""
    lines = [OLD.replace("      100/", f"{step:9d}/") for step in range(10, 30_010, 10)]
    text = "\n".join(lines) + "\n"
    at_once, one_by_one = [], []
    with pytest.MonkeyPatch.context() as patch:
        batch, values = megatron._Layout.batch, megatron._Layout.values
        patch.setattr(megatron._Layout, "batch", lambda *a: at_once.append(1) or batch(*a))
        patch.setattr(megatron._Layout, "values", lambda *a: one_by_one.append(1) or values(*a))
        notes: list[Note] = []
        recs = parse("megatron", text, notes)
    slow: list[Note] = []
    assert same(recs, general(text, slow)) and notes == slow and len(recs) == 3000
    assert at_once and len(one_by_one) < 10  # (the line that makes the interval known)
