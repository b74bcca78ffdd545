"""#41, "The API": a wrong argument gets one sentence naming it, what it takes and what was
given (Lightning's ``EarlyStopping`` style), never a ``TypeError`` from deep inside, and never
silence."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

from stabilizer.callbacks.monitor import StabilityMonitor
from stabilizer.hosts.loop import Stabilizer
from stabilizer.step.options import Options
from stabilizer.step.policies import Auto, Protect


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(2, 2)
    return model, torch.optim.AdamW(model.parameters())


BAD_STABILIZER: list[tuple[str, Any, type[Exception], str]] = [
    (
        "optimizer and model swapped",
        lambda m, o: Stabilizer(o, m),
        TypeError,
        r"`model` must be a torch.nn.Module, got AdamW \(pass the model first, then the "
        r"optimizer\)",
    ),
    (
        "no optimizer",
        lambda m, o: Stabilizer(m, None),
        TypeError,
        r"`optimizers` must be a torch optimizer or a sequence of them, got None",
    ),
    (
        "clip as text",
        lambda m, o: Stabilizer(m, o, clip="1"),
        TypeError,
        r"`clip` must be a number > 0 or None, got '1'",
    ),
    (
        "misspelled option",
        lambda m, o: Stabilizer(m, o, jsnol=False),
        TypeError,
        r"unknown option `jsnol`; did you mean `jsonl`\? The options are: ",
    ),
    (
        "unknown precision",
        lambda m, o: Stabilizer(m, o, precision="fp8"),
        ValueError,
        r"`precision` must be one of .*'bf16-mixed'.*, got 'fp8'",
    ),
    (
        "grouping not a function",
        lambda m, o: Stabilizer(m, o, grouping="x"),
        TypeError,
        r"`grouping` must be a function from a parameter name to its depth group, or None, "
        r"got 'x'",
    ),
    (
        "a policy's knob",
        lambda m, o: Stabilizer(m, o, stop_after=3),
        TypeError,
        r"`stop_after` is a knob of the policy: pass policy=Protect\(stop_after=3\)",
    ),
]


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [case[1:] for case in BAD_STABILIZER],
    ids=[case[0] for case in BAD_STABILIZER],
)
def test_the_stabilizer_says_what_is_wrong(make: Any, error: type[Exception], match: str) -> None:
    model, optimizer = _model()
    with pytest.raises(error, match=match):
        make(model, optimizer)


BAD_KNOBS: list[tuple[str, Any, type[Exception], str]] = [
    ("stop_after text", lambda: Protect(stop_after="10"), TypeError,
     r"`stop_after` must be an int >= 1 or None, got '10'"),
    ("stop_after 0", lambda: Protect(stop_after=0), ValueError,
     r"`stop_after` must be an int >= 1 or None, got 0"),
    ("max_root_causes float", lambda: Protect(max_root_causes=1.5), TypeError,
     r"`max_root_causes` must be an int >= 0, got 1.5"),
    ("guard_optimizer text", lambda: Protect(guard_optimizer="yes"), TypeError,
     r"`guard_optimizer` must be True, False or None, got 'yes'"),
    ("max_rollbacks text", lambda: Auto(max_rollbacks="3"), TypeError,
     r"`max_rollbacks` must be an int >= 0, got '3'"),
    ("allow a string", lambda: Auto(allow="rollback"), TypeError,
     r"`allow` must be a collection of remedy names or None, got 'rollback'"),
    ("heatmap_every text", lambda: Options(heatmap_every="5"), TypeError,
     r"`heatmap_every` must be an int >= 0, got '5'"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [case[1:] for case in BAD_KNOBS],
    ids=[case[0] for case in BAD_KNOBS],
)
def test_the_policies_and_options_say_what_is_wrong(
    make: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        make()


BAD_MONITOR: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("a policy's knob", {"stop_after": 3}, TypeError,
     r"`stop_after` is a knob of the policy: pass policy=Protect\(stop_after=3\)"),
    ("grouping", {"grouping": "x"}, TypeError,
     r"`grouping` must be a function from a parameter name"),
    ("jsonl", {"jsonl": 3}, TypeError, r"`jsonl` must be a path, True or False, got 3"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [case[1:] for case in BAD_MONITOR],
    ids=[case[0] for case in BAD_MONITOR],
)
def test_the_monitor_says_what_is_wrong(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        StabilityMonitor(**kwargs)


def test_a_misspelled_policy_is_named_with_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="`policy` must be one of protect, observe, auto or a "):
        StabilityMonitor(policy="protcet")


def test_the_hf_callback_says_what_is_wrong() -> None:
    pytest.importorskip("transformers")
    from stabilizer.hosts.hf import StabilityCallback

    with pytest.raises(
        TypeError, match=re.escape("unknown option `activaton_every`; did you mean")
    ):
        StabilityCallback(activaton_every=3)
