"""`Stabilizer` in plain loops as people write them: accumulation, an fp16 scaler, their own
clipping, several optimizers, a loss computed outside the model, a resume, a crash. (DDP, Fabric
and the examples: tests/test_examples.py; the same run under every host: test_hosts_parity.)"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor, nn
from torch.utils.tensorboard import SummaryWriter

from stabilizer.demo.model import GPT, GPTConfig
from stabilizer.hosts.loop import Stabilizer
from stabilizer.step.policies import Protect

Loss = Callable[[GPT, Tensor, int], Tensor]


def model_loss(gpt: GPT, ids: Tensor, step: int) -> Tensor:
    _, loss = gpt(ids, ids)
    assert loss is not None
    return loss


def tiny(nan_at: int | range = -1, micro: int = 0) -> tuple[GPT, dict[str, int]]:
    """A 2-block GPT whose block 1 MLP outputs NaN at step `nan_at` (or steps), micro-batch
    `micro`."""
    steps = nan_at if isinstance(nan_at, range) else range(nan_at, nan_at + 1)
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=16))
    at = {"step": 0, "micro": 0}

    def fault(module: nn.Module, args: Any, out: Tensor) -> Tensor | None:
        hit = at["step"] in steps and at["micro"] == micro
        return out * float("nan") if module.training and hit else None

    gpt.get_submodule("blocks.1.mlp").register_forward_hook(fault)
    return gpt, at


def train(
    stab: Stabilizer,
    gpt: GPT,
    at: dict[str, int],
    steps: range,
    *,
    accumulate: int = 1,
    loss_fn: Loss = model_loss,
) -> None:
    optimizer = stab.host.optimizers[0]
    for step in steps:
        at["step"] = step
        with stab.step():
            for micro in range(accumulate):
                at["micro"] = micro
                gen = torch.Generator().manual_seed(step * 10 + micro)
                ids = torch.randint(0, 256, (4, 16), generator=gen)
                stab.backward(loss_fn(gpt, ids, step) / accumulate)
            optimizer.step()
            optimizer.zero_grad()


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def steps_of(path: Path) -> dict[int, dict[str, Any]]:
    return {r["step"]: r["values"] for r in records(path) if r["type"] == "step"}


def test_a_nan_in_an_accumulated_step_is_skipped_and_named(tmp_path: Path) -> None:
    """The NaN of the second micro-batch: skipped, weights bit-identical, named; the records
    in the JSONL and TensorBoard, the norm before the Stabilizer's clipping."""
    gpt, at = tiny(nan_at=3, micro=1)
    optimizer = torch.optim.AdamW(gpt.parameters())
    writer = SummaryWriter(tmp_path / "tb")
    stab = Stabilizer(gpt, optimizer, clip=0.1, log_dir=tmp_path, tensorboard=writer)
    with stab:
        train(stab, gpt, at, range(3), accumulate=2)
        before = [p.detach().clone() for p in gpt.parameters()]
        train(stab, gpt, at, range(3, 4), accumulate=2)
        assert all(torch.equal(a, b) for a, b in zip(before, gpt.parameters(), strict=True))
        train(stab, gpt, at, range(4, 6), accumulate=2)
    found = {f.kind: f for f in stab.findings}
    assert set(found) == {"nonfinite_loss", "root_cause"} and stab.skipped_steps == 1
    cause = found["root_cause"]
    assert cause.step == 3 and cause.location == ("blocks.1.mlp",)
    assert cause.seen.startswith("micro-batch 2 of 2: blocks.1.mlp produced NaN/Inf")
    values = steps_of(tmp_path / "stability.jsonl")
    assert sorted(values) == list(range(6)) and values[3]["skipped"] == 1.0
    assert values[2]["clipped"] == 1.0 and values[2]["grad_norm"] > 0.1  # before clipping
    assert all(math.isfinite(values[s]["loss"]) for s in (4, 5))
    assert "step" not in optimizer.__dict__ and not gpt._forward_pre_hooks  # all put back
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("stability/grad_norm")] == list(range(6))
    assert "stability/grad_norm_heatmap" in events.Tags()["images"]


def test_a_nan_made_outside_the_model_is_not_called_transient(tmp_path: Path) -> None:
    """The replay runs the model's calls: a NaN made by the loss code around them stays out of
    it, and the root cause says so instead of calling the fault transient."""

    def loss_fn(gpt: GPT, ids: Tensor, step: int) -> Tensor:
        logits, _ = gpt(ids)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
        return loss * float("nan") if step == 2 else loss

    gpt, at = tiny()
    with Stabilizer(gpt, torch.optim.AdamW(gpt.parameters()), jsonl=False) as stab:
        train(stab, gpt, at, range(4), loss_fn=loss_fn)
    (cause,) = [f for f in stab.findings if f.kind == "root_cause"]
    assert cause.severity.name == "WARNING" and "transient (non-deterministic)" not in cause.seen
    assert cause.seen.startswith("the replay of the model's calls stayed finite: the NaN/Inf")
    assert "code outside the model" in cause.seen


def test_an_fp16_scaler_overflow_is_measured_and_the_loops_own_clipping_too(
    tmp_path: Path,
) -> None:
    """nanoGPT's fp16 step: scale, unscale, clip, ``scaler.step``. The NaN step never reaches
    the optimizer (the scaler skips it) and is still measured and reported; ``before_step``
    is not needed: the norm is taken as the scaler unscales, before the loop's clipping."""
    gpt, at = tiny(nan_at=2)
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    stab = Stabilizer(gpt, optimizer, scaler=scaler, log_dir=tmp_path)  # fp16: "16-mixed"
    with stab:
        for step in range(5):
            at["step"] = step
            with stab.step():
                with torch.autocast("cpu", torch.float16):
                    loss = model_loss(gpt, torch.randint(0, 256, (4, 16)), step)
                stab.backward(loss)
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(gpt.parameters(), 0.01)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
    values = steps_of(tmp_path / "stability.jsonl")
    assert stab.host.facts.precision == "16-mixed" and sorted(values) == list(range(5))
    assert values[2]["skipped"] == 1.0 and values[2]["loss_scale"] == 65536.0
    assert values[3]["loss_scale"] == 32768.0  # the scaler halved it
    assert values[3]["grad_norm"] > 0.01  # measured before the loop's clipping
    kinds = [(f.kind, f.step) for f in stab.findings if f.kind != "config_risk"]
    assert kinds == [("nonfinite_loss", 2), ("root_cause", 2)]
    assert "unscale_" not in scaler.__dict__  # the scaler is the loop's again


def test_two_optimizers_share_the_step_and_each_is_decided_on_its_own(tmp_path: Path) -> None:
    """Two optimizers in one block (an Adam for embeddings, another for the blocks, as
    modded-nanoGPT's loop steps them): both guarded, one step number, their own streams."""
    gpt, at = tiny(nan_at=1)
    embed = [p for n, p in gpt.named_parameters() if n.startswith("w")]
    rest = [p for n, p in gpt.named_parameters() if not n.startswith("w")]
    first, second = torch.optim.AdamW(embed), torch.optim.SGD(rest, lr=0.1)
    with Stabilizer(gpt, [first, second], log_dir=tmp_path) as stab:
        for step in range(3):
            at["step"] = step
            with stab.step():
                stab.backward(model_loss(gpt, torch.randint(0, 256, (4, 16)), step))
                for opt in (first, second):
                    opt.step()
                    opt.zero_grad()
    assert stab.host.step == 3 and stab.skipped_steps == 2  # step 1, both optimizers
    rows = [r for r in records(tmp_path / "stability.jsonl") if r["type"] == "step"]
    assert [r["step"] for r in rows] == [0, 0, 1, 1, 2, 2]
    assert "opt2/grad_norm" in rows[1]["values"] and rows[3]["values"]["opt2/skipped"] == 1.0


def test_a_resumed_loop_reports_as_the_whole_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`state_dict` rides in the loop's checkpoint; a run resumed from it finds what the run
    uninterrupted found (a NaN episode across the checkpoint that turns persistent after it),
    and appends to its own default JSONL."""
    monkeypatch.chdir(tmp_path)  # the default JSONL: stability_logs/version_N/ here

    def run(steps: range, state: dict[str, Any] | None, model: GPT | None = None) -> Any:
        gpt, at = tiny(nan_at=range(2, 8))
        if model is not None:
            gpt.load_state_dict(model.state_dict())
        opt = torch.optim.SGD(gpt.parameters(), lr=0.05)
        stab = Stabilizer(gpt, opt, policy=Protect(stop_after=None), preflight=False)
        if state is not None:
            stab.load_state_dict(state)
        with stab:
            train(stab, gpt, at, steps)
            return stab.findings, stab.state_dict(), gpt

    whole, _, _ = run(range(9), None)
    assert any(f.severity.name == "CRITICAL" for f in whole)  # the episode persisted
    _, state, gpt = run(range(4), None)
    assert state["bad_in_a_row"] == 2  # steps 2 and 3 were bad at the checkpoint
    resumed, after, _ = run(range(4, 9), state, gpt)

    def said(found: list[Any]) -> list[tuple[Any, ...]]:  # (the replay's time varies)
        return [(f.kind, f.step, f.end_step, f.severity, f.location, f.seen[:60]) for f in found]

    assert said(resumed) == said(whole)
    assert after["step"] == 9 and after["jsonl"] == state["jsonl"]
    resumed_log = tmp_path / state["jsonl"]
    assert sorted(steps_of(resumed_log)) == list(range(9))  # the resumed run went on in it


def test_a_crash_in_the_loop_keeps_the_lines_and_unguards(tmp_path: Path) -> None:
    gpt, at = tiny()
    optimizer = torch.optim.AdamW(gpt.parameters())
    stab = Stabilizer(gpt, optimizer, log_dir=tmp_path)
    with pytest.raises(RuntimeError, match="the user's bug"), stab:
        train(stab, gpt, at, range(2))
        with stab.step():
            raise RuntimeError("the user's bug")
    assert "step" not in optimizer.__dict__ and not gpt._forward_pre_hooks
    assert sorted(steps_of(tmp_path / "stability.jsonl")) == [0, 1]


def test_wrong_settings_say_what_is_wrong() -> None:
    gpt, _ = tiny()
    optimizer = torch.optim.AdamW(gpt.parameters())
    with pytest.raises(ValueError, match=r"`clip` must be a number > 0 or None, got 0"):
        Stabilizer(gpt, optimizer, clip=0)
    with pytest.raises(TypeError, match=r"`stop_after` is a knob of the policy"):
        Stabilizer(gpt, optimizer, stop_after=3)  # a policy's knob, not the monitor's
    stab = Stabilizer(gpt, optimizer, jsonl=False)
    with stab.step():
        pass
    with pytest.raises(RuntimeError, match="`load_state_dict` must come before the first step"):
        stab.load_state_dict({})
    stab.close()


def test_observe_reports_and_lets_the_update_through(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Without a guard the step is measured inside the optimizer step all the same; the NaN
    reaches the weights, and the console says so."""
    gpt, at = tiny(nan_at=1)
    with Stabilizer(gpt, torch.optim.SGD(gpt.parameters(), lr=0.1), "observe", clip=1.0,
                    log_dir=tmp_path) as stab:  # fmt: skip
        train(stab, gpt, at, range(3))
    values = steps_of(tmp_path / "stability.jsonl")
    assert sorted(values) == [0, 1, 2] and "skipped" not in values[1]
    assert values[0]["grad_norm"] > values[0]["clip_val"] == 1.0  # measured before clipping
    assert not all(torch.isfinite(p).all() for p in gpt.parameters())
    # The NaN, then, at the run's end, how long it lasted: the weights stayed NaN (INFO).
    assert [(f.kind, f.step, f.end_step, f.severity.name) for f in stab.findings] == [
        ("nonfinite_loss", 1, 1, "ERROR"),
        ("nonfinite_loss", 1, 2, "INFO"),
    ]
    assert "loss is nan at step 1; the update was applied" in caplog.text
