"""Shared by the reader tests: the fixtures, what each must give, and small helpers."""

from __future__ import annotations

import io
from pathlib import Path

from stabilizer.core.engine import Engine
from stabilizer.core.records import Finding, Severity, StepRecord
from stabilizer.replay.readers import READERS, Item, Note, Restart, read_log

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "logs"

# fixture (file or run directory) → (format, kinds the failing run must be found with)
CASES: dict[str, tuple[str, tuple[str, ...]]] = {
    "jsonl_healthy.jsonl": ("jsonl", ()),
    "jsonl_failing.jsonl": ("jsonl", ("nonfinite_loss",)),
    "lightning_csv_healthy": ("lightning_csv", ()),
    "lightning_csv_failing": ("lightning_csv", ("loss_spike",)),
    "tensorboard_healthy": ("tensorboard", ()),
    "tensorboard_failing": ("tensorboard", ("depth_imbalance",)),
    "tensorboard_stability": ("tensorboard", ()),
    "tensorboard_tf2": ("tensorboard", ()),
    "megatron_healthy.log": ("megatron", ()),
    "megatron_failing.log": ("megatron", ("nonfinite_loss", "fp16_overflow")),
    "deepspeed_healthy.log": ("deepspeed", ()),
    "deepspeed_failing.log": ("deepspeed", ("fp16_overflow",)),
    "hf_trainer_healthy.log": ("hf_trainer", ()),
    "hf_trainer_failing.log": ("hf_trainer", ("nonfinite_grad",)),
    "hf_trainer_state_healthy": ("hf_trainer_state", ()),
    "hf_trainer_state_failing": ("hf_trainer_state", ("loss_spike",)),
    "fairseq_healthy.log": ("fairseq", ()),
    "fairseq_failing.log": ("fairseq", ("fp16_overflow",)),
    "nanogpt_healthy.log": ("generic", ()),
    "nanogpt_failing.log": ("generic", ("loss_spike",)),
    "modded_nanogpt_healthy.log": ("generic", ()),
    "modded_nanogpt_failing.log": ("generic", ("nonfinite_loss",)),
    "generic_healthy.log": ("generic", ()),
    "generic_failing.log": ("generic", ("divergence",)),
    "nanogpt_resumed.log": ("generic", ()),
}


def fixture(name: str) -> Path:
    return FIXTURES / name


def items(name: str, notes: list[Note] | None = None) -> list[Item]:
    """Every item (records, restarts) of a fixture, read with format detection."""
    return list(read_log(fixture(name), notes=notes))


def records(name: str, notes: list[Note] | None = None) -> list[StepRecord]:
    """Every record of a fixture, read with format detection."""
    return only_records(items(name, notes))


def parse_items(format: str, text: str | bytes, notes: list[Note] | None = None) -> list[Item]:
    """The items (records, restarts) one reader makes of ``text``."""
    data = text.encode() if isinstance(text, str) else text
    return list(READERS[format](notes).read(io.BytesIO(data)))


def parse(format: str, text: str | bytes, notes: list[Note] | None = None) -> list[StepRecord]:
    """The records one reader makes of ``text``."""
    return only_records(parse_items(format, text, notes))


def only_records(found: list[Item]) -> list[StepRecord]:
    return [item for item in found if isinstance(item, StepRecord)]


def restarts(found: list[Item]) -> list[tuple[int, int | None, str]]:
    """``(step, line, why)`` of each `Restart` among ``found``."""
    return [(item.step, item.line, item.why) for item in found if isinstance(item, Restart)]


def findings(recs: list[StepRecord]) -> list[Finding]:
    """What the real engine, with its default detectors, finds in ``recs``."""
    return Engine().replay(recs)


def serious(found: list[Finding]) -> list[Finding]:
    return [f for f in found if f.severity >= Severity.WARNING]


def kinds(found: list[Finding]) -> set[str]:
    return {f.kind for f in serious(found)}
