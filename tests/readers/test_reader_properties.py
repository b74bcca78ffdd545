"""Untrusted input: whatever the bytes, readers raise nothing but `LogReadError`."""

from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reader_cases import fixture, parse

from stabilizer.core.records import StepRecord
from stabilizer.replay.readers import READERS, LogReadError, detect_format, read_log

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Lines that look like every format, to be cut, spliced and garbled.
SEEDS = [
    '{"type":"step","step":1,"values":{"loss":"nan"}}',
    "epoch,step,train_loss_step\n0,1,2.5",
    " iteration 10/ 100 | lm loss: 3.0E+00 | loss scale: 1.0 | number of nan iterations: 1 |",
    "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 4, reducing to 2",
    "[Rank 0] step=10, skipped=0, lr=[0.1]",
    "{'loss': nan, 'grad_norm': tensor(1.0), 'learning_rate': 1e-4}",
    '{"log_history": [{"loss": 1, "step": 1}, {"step": ',
    "| INFO | train_inner | epoch 001: 1 / 9 loss=1, num_updates=1, clip=100",
    "iter 1: loss 2.0, time 1ms, mfu 1%",
    "step:1/9 train_loss:nan train_time:1ms step_avg:nanms",
    "step=1 loss=2 lr=3e-4",
    "Resuming training from out",
]
lines = st.lists(
    st.one_of(
        st.sampled_from(SEEDS), st.text(max_size=80), st.sampled_from(SEEDS).map(lambda s: s[:40])
    ),
    max_size=30,
)


def read_all(format: str, data: bytes) -> list[StepRecord]:
    recs = list(READERS[format]().read(io.BytesIO(data)))
    assert all(
        isinstance(r.step, int) and all(isinstance(v, float) for v in r.values.values())
        for r in recs
    )
    return recs


@pytest.mark.parametrize("format", READERS)
@FAST
@given(data=st.binary(max_size=3000))
def test_arbitrary_bytes(format: str, data: bytes) -> None:
    with contextlib.suppress(LogReadError):
        read_all(format, data)


@pytest.mark.parametrize("format", READERS)
@FAST
@given(text=lines)
def test_arbitrary_lines(format: str, text: list[str]) -> None:
    with contextlib.suppress(LogReadError):
        read_all(format, "\n".join(text).encode())


EVENTS = next(fixture("tensorboard_stability").glob("events.out.tfevents.*")).read_bytes()[:3000]


@FAST
@given(cut=st.integers(0, len(EVENTS)), flips=st.lists(st.integers(0, len(EVENTS) - 1), max_size=5))
def test_damaged_event_files(cut: int, flips: list[int]) -> None:
    data = bytearray(EVENTS[:cut])
    for at in flips:
        if at < len(data):
            data[at] ^= 0x5A
    recs = read_all("tensorboard", bytes(data))
    assert all(not math.isnan(r.step) for r in recs)


@FAST
@given(data=st.binary(max_size=2000))
def test_read_log_on_arbitrary_files(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    path: Path = tmp_path_factory.getbasetemp() / "fuzz.log"
    path.write_bytes(data)
    with contextlib.suppress(LogReadError):
        list(read_log(path))


PATHOLOGICAL = {
    "word": "a" * 50_000,
    "dashes": "-" * 50_000,
    "quoted": "'" + "a" * 50_000,
    "pairs": "a=1 " * 12_500,
    "steps": "step=" * 10_000,
    "osc": "\x1b]" + "x" * 50_000,
    "bars": "|" + " " * 50_000,
}


@pytest.mark.parametrize("format", READERS)
def test_long_pathological_lines(format: str) -> None:
    """Lines that make a backtracking regex take minutes are read like any other (regression).

    No bound on the time, which would depend on the machine: a regex that backtracks shows as a
    test that does not finish."""
    for line in PATHOLOGICAL.values():
        with contextlib.suppress(LogReadError):
            read_all(format, (line + "\n").encode() * 2)
        with contextlib.suppress(LogReadError):
            detect_format([line])


VALID = "2024-01-01 12:00:00 | INFO | valid | epoch 001 | valid on 'valid' subset | loss {} | "
INNER = (
    "2024-01-01 12:00:00 | INFO | train_inner | epoch 001:  {0} / 9 loss=2.5, num_updates={0}, "
    "lr=0.1"
)
# format → (a good line with a step "{}", lines whose numbers cannot be a step or a value)
ODD_NUMBERS = {
    "generic": ("step={} loss=2.5", ["step=nan loss=1", "step=inf loss=1", "step=1e400 loss=3"]),
    "jsonl": (
        '{{"type":"step","step":{},"values":{{"loss":2.5}}}}',
        ['{"type":"step","step":7,"values":{"loss":1' + "0" * 400 + "}}", '{"step":1e400,"a":1}'],
    ),
    "fairseq": (INNER, [VALID.format("x") + "num_updates 5", VALID.format(8) + "num_updates nan"]),
    "hf_trainer": (
        "{{'loss': 2.5, 'learning_rate': 1e-05, 'epoch': 0.1, 'step': {}}}",
        ["{'loss': 2.4, 'epoch': 0.2, 'step': nan}", "{'loss': 2.4, 'epoch': 0.2, 'step': inf}"],
    ),
}


@pytest.mark.parametrize("format", sorted(ODD_NUMBERS))
def test_a_line_of_odd_numbers_is_skipped_and_reading_goes_on(format: str) -> None:
    good, odd = ODD_NUMBERS[format]
    text = "\n".join([good.format(1), *odd, good.format(2)]) + "\n"
    assert [record.step for record in parse(format, text)] == [1, 2]
