"""Round 9: setups outside the suite, each as a user writes it (`setups_harness.check`).

The names say the host (``pl-``: Lightning, ``hf-``: the HF Trainer, ``fabric-``: Fabric, the
rest a plain loop). Each trains healthy as without the monitor (bit for bit), and with one NaN
skips exactly that step, leaves the state as it was and makes only true claims. The breaks
round 9 found have their own tests below (each failed before its fix).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from setups_harness import NAN, Ctx, check, mse, train
from setups_r9_hf import HF9
from setups_r9_lightning import LIGHTNING9
from setups_r9_loop import LOOP9
from setups_r9_models import MODELS9

SETUPS = {**LOOP9, **MODELS9, **LIGHTNING9, **HF9}
OPTIMIZERS = {"fabric-gan-two-models": 2, "two-updates-a-block": 2}
SCALER_SKIPS = {"gradscaler-own-skips": 2}
FITS = {"hf-resume-from-checkpoint-true": 2}
OWN_TEST = {  # (checked below: what holds there is not the harness's three runs)
    "pl-detect_anomaly",
    "pl-training_step-returns-None-on-nan",
}


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Tiny models: one torch thread (see conftest)."""


@pytest.mark.parametrize("name", [name for name in SETUPS if name not in OWN_TEST])
def test_a_setup_holds(name: str, tmp_path: Path) -> None:
    """The healthy run as without the monitor, the NaN step skipped, every claim true."""
    if name in HF9 or "peft" in name:
        pytest.importorskip("transformers")
    if "peft" in name:
        pytest.importorskip("peft")
    check(
        SETUPS[name], tmp_path, optimizers=OPTIMIZERS.get(name, 1),
        scaler_skips=SCALER_SKIPS.get(name, 0), fits=FITS.get(name, 1),
    )  # fmt: skip


def test_a_step_the_user_skips_by_returning_none_is_theirs(tmp_path: Path) -> None:
    """``training_step`` returning None on its own NaN loss: no backward, no update; the
    monitor neither skips nor calls anything NaN (it never saw the loss), and the state at the
    step is as before it."""
    t = train(SETUPS["pl-training_step-returns-None-on-nan"], Ctx(tmp_path, True, nan_at=3))
    assert t.ctx.before is not None and t.ctx.after is not None
    assert all(torch.equal(a, b) for a, b in zip(t.ctx.before, t.ctx.after, strict=True))
    assert t.front.skipped_steps == 0
    assert not [f for f in t.front.findings if f.kind in NAN]
    assert [r for r in t.rows if r["type"] == "step"][3]["values"].get("loss") is None


def test_detect_anomaly_raises_as_without_the_monitor(tmp_path: Path) -> None:
    """``Trainer(detect_anomaly=True)`` beside the monitor: healthy, bit-identical; a NaN
    raises anomaly mode's own error in the user's backward, with or without the monitor (as
    the user asked), and the monitor lets go of the optimizer."""
    run = SETUPS["pl-detect_anomaly"]
    bare, healthy = (train(run, Ctx(tmp_path / k, m)) for k, m in (("a", False), ("b", True)))
    assert all(torch.equal(a, b) for a, b in zip(bare.ctx.final, healthy.ctx.final, strict=True))
    assert healthy.front.skipped_steps == 0
    for monitored in (False, True):
        with pytest.raises(RuntimeError, match="returned nan values"):
            train(run, Ctx(tmp_path / f"nan{monitored}", monitored, nan_at=3))


# --- the breaks round 9 found ---------------------------------------------------------------


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("name", ["sam-two-step", "pl-manual-sam"])
def test_sams_step_is_its_base_optimizers_and_its_loss_the_second_pass(
    name: str, tmp_path: Path
) -> None:
    """SAM (``first_step``/``second_step``: the base optimizer, which shares SAM's param
    groups, steps inside the second) was never seen: no record, "healthy", and a NaN went
    into the weights. Now its base optimizer is guarded; and the first pass's gradients, let
    go by ``first_step(zero_grad=True)``, are no part of the step: the record's loss is the
    second pass's, not the sum of both."""
    t = check(SETUPS[name], tmp_path)["healthy"]
    steps = [r["values"] for r in t.rows if r["type"] == "step"]
    assert len(steps) == 6
    net, opt = _sam_twin()  # (the second passes, recomputed as the run went)
    for (x, y), rec in zip(Ctx(tmp_path, False).batches(), steps, strict=True):
        mse(net(x), y).backward()
        opt.first_step(zero_grad=True)
        second = mse(net(x), y)
        second.backward()
        opt.second_step(zero_grad=True)
        assert rec["loss"] == pytest.approx(float(second), rel=1e-6)


def _sam_twin() -> tuple[torch.nn.Module, Any]:
    from setups_harness import Net
    from setups_r9_loop import SAM

    net = Net()
    return net, SAM(net.parameters(), torch.optim.SGD, lr=1e-2, momentum=0.9)


def _nan_from(module: torch.nn.Module, at: range, now: dict[str, int]) -> None:
    module.register_forward_hook(lambda m, a, out: out * math.nan if now["i"] in at else None)


def _upcast(found: list[Any]) -> Any:
    (applied,) = [f for f in found if f.kind == "remedy_applied" and "upcast" in f.seen]
    return applied


def test_auto_upcasts_torchs_layers_and_says_what_it_could_not_loop(tmp_path: Path) -> None:
    """torch's own post-LN ``nn.TransformerEncoderLayer`` in pure fp16 (``.half()``), under
    ``auto``, a NaN that persists: the remedy makes its LayerNorms fp32 and says that
    ``nn.MultiheadAttention``'s softmax stayed as it was (it said "norms and attention softmax
    now in fp32"); the run told no precision is the weights' ``16-true`` (it said
    ``32-true``, and ``auto`` never tried the remedy)."""
    from setups_r9_models import TorchEncoderLM, next_token, tokens

    from stabilizer import Auto
    from stabilizer.hosts.loop import Stabilizer
    from stabilizer.live.remedies.upcast_to_fp32 import FP32LayerNorm

    model, now = TorchEncoderLM().half(), {"i": 0}
    _nan_from(model.body.layers[1].linear2, range(3, 6), now)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    with Stabilizer(model, opt, Auto(), jsonl=tmp_path / "s.jsonl") as stab:
        for i, ids in enumerate(tokens(Ctx(tmp_path, True)) * 2):
            now["i"] = i
            with stab.step():
                stab.backward(next_token(model, ids).float())
                opt.step()
                opt.zero_grad()
    assert _rows(tmp_path / "s.jsonl")[0]["precision"] == "16-true"
    applied = _upcast(stab.findings)
    assert "4 norms now in fp32" in applied.seen and "attention softmax now" not in applied.seen
    assert "2 attention softmaxes left as they were" in applied.seen
    assert applied.evidence["unswitched"] == 2 and applied.evidence["attention"] == 0
    assert isinstance(model.body.layers[0].norm1, FP32LayerNorm)


def test_auto_upcasts_torchs_layers_and_says_what_it_could_not_lightning(tmp_path: Path) -> None:
    """The same model under Lightning's ``precision="16-true"``."""
    import lightning.pytorch as pl
    from setups_r9_models import TorchEncoderLM, next_token, tokens
    from torch.utils.data import DataLoader

    from stabilizer import Auto
    from stabilizer.callbacks.monitor import StabilityMonitor

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = TorchEncoderLM()
            _nan_from(self.model.body.layers[1].linear2, range(3, 6), now)

        def training_step(self, ids: torch.Tensor, i: int) -> torch.Tensor:
            now["i"] = self.global_step
            return next_token(self.model, ids).float()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3, eps=1e-4)

    now = {"i": 0}
    monitor = StabilityMonitor(policy=Auto(), jsonl=tmp_path / "s.jsonl")
    trainer = pl.Trainer(
        accelerator="cpu", precision="16-true", max_steps=12, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[monitor],
    )  # fmt: skip
    trainer.fit(Lit(), DataLoader(tokens(Ctx(tmp_path, True)) * 2, batch_size=None))
    applied = _upcast(monitor.findings)
    assert "4 norms now in fp32" in applied.seen and "attention softmax now" not in applied.seen
    assert "2 attention softmaxes left as they were" in applied.seen


def test_an_hf_model_loaded_in_bf16_is_said_to_train_in_bf16(tmp_path: Path) -> None:
    """A model in bf16 (``torch_dtype=torch.bfloat16``) trained by the HF Trainer without
    ``bf16=True`` computes in bf16: the run's header says ``bf16-true`` (it said ``32-true``)."""
    pytest.importorskip("transformers")
    from setups_hf import hf
    from setups_r9_hf import decoder, lm_data

    ctx = Ctx(tmp_path, True)
    hf(ctx, model=decoder("Llama").to(torch.bfloat16), data=lm_data())
    assert _rows(ctx.jsonl)[0]["precision"] == "bf16-true"


@pytest.mark.parametrize("policy", ["observe", "protect"])
def test_a_wrapper_optimizer_is_one_step_a_block_under_each_policy(
    policy: str, tmp_path: Path
) -> None:
    """SAM (its base optimizer steps on its own) and a Lookahead (its ``step`` steps the base
    inside): one record a step, under ``observe`` too (SAM's base optimizer was never seen; a
    Lookahead's base step inside its own must not count twice)."""
    from setups_harness import Net
    from setups_r9_loop import SAM, Lookahead

    from stabilizer.hosts.loop import Stabilizer

    for kind in ("sam", "lookahead"):
        net, jsonl = Net(), tmp_path / f"{kind}.jsonl"
        opt: Any = (
            SAM(net.parameters(), torch.optim.SGD, lr=1e-2) if kind == "sam"
            else Lookahead(torch.optim.AdamW(net.parameters(), lr=1e-2))
        )  # fmt: skip
        with Stabilizer(net, opt, policy, jsonl=jsonl) as stab:
            for x, y in Ctx(tmp_path, True).batches():
                with stab.step():
                    stab.backward(mse(net(x), y))
                    if kind == "sam":
                        opt.first_step(zero_grad=True)
                        stab.backward(mse(net(x), y))
                        opt.second_step(zero_grad=True)
                    else:
                        opt.step()
                        opt.zero_grad()
        assert [r["step"] for r in _rows(jsonl) if r["type"] == "step"] == list(range(6)), kind


def test_two_updates_in_one_block_are_two_steps(tmp_path: Path) -> None:
    """One optimizer stepping twice in one ``with stab.step()`` block (an inner loop): each
    update is a step of its own, numbered in turn (both were recorded at the block's step:
    two records per step number, "steps 3-3 (2 records)", the end line at half the steps)."""
    t = check(SETUPS["two-updates-a-block"], tmp_path, optimizers=2)["nan"]
    steps = [r["step"] for r in t.rows if r["type"] == "step"]
    assert steps == list(range(12))
    assert [r["step"] for r in t.rows if r["type"] == "step" and r["values"]["skipped"]] == [6, 7]
    assert any(line.startswith("stabilizer: done at step 12") for line in t.lines)


def test_an_optimizer_of_another_model_is_not_taken_for_a_new_one(tmp_path: Path) -> None:
    """A new optimizer over the model's parameters joins the guarded ones
    (``new-optimizer-mid-run``, above); one over parameters the model does not hold (a
    separate model the loop also trains, not given to the Stabilizer) is left alone."""
    from setups_harness import Net

    from stabilizer.hosts.loop import Stabilizer

    net, other = Net(), Net(width=6)
    opt, own = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (net, other))
    with Stabilizer(net, opt, jsonl=tmp_path / "s.jsonl") as stab:
        for x, y in Ctx(tmp_path, True).batches():
            with stab.step():
                stab.backward(mse(net(x), y))
                mse(other(x), y).backward()
                opt.step()
                own.step()
                opt.zero_grad()
                own.zero_grad()
    rows = [r for r in _rows(tmp_path / "s.jsonl") if r["type"] == "step"]
    assert len(rows) == 6 and not any(k.startswith("opt2/") for r in rows for k in r["values"])
    assert stab.host.optimizers == [opt]


@pytest.mark.parametrize("on_disk", [False, True])
def test_a_rollback_of_sam_puts_its_base_optimizers_state_back(
    on_disk: bool, tmp_path: Path
) -> None:
    """``auto``'s rollback (`Snapshots`) of a SAM run, reachable once SAM's steps are seen:
    SAM's ``state_dict`` holds no momentum (its base optimizer's), which stayed where the
    bad steps left it; now the base optimizer's state is snapshotted and put back too."""
    from setups_harness import Net
    from setups_r9_loop import SAM

    from stabilizer.live.remedies.rollback import Snapshots

    net = Net()
    opt = SAM(net.parameters(), torch.optim.SGD, lr=1e-2, momentum=0.9)

    def sam_step(x: torch.Tensor, y: torch.Tensor) -> None:
        mse(net(x), y).backward()
        opt.first_step(zero_grad=True)
        mse(net(x), y).backward()
        opt.second_step(zero_grad=True)

    batches = Ctx(tmp_path, False).batches()
    sam_step(*batches[0])
    kept = {"dir": tmp_path / "snap", "bytes": 0} if on_disk else {"dir": None, "bytes": 1 << 30}
    snaps = Snapshots(net, opt, every=1, directory=kept["dir"], max_memory_bytes=kept["bytes"])
    snaps.save(1)
    saved = [s["momentum_buffer"].clone() for s in opt.base_optimizer.state.values()]
    for x, y in batches[1:3]:
        sam_step(x, y)
    assert snaps.restore() == 1
    back = [s["momentum_buffer"] for s in opt.base_optimizer.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(saved, back, strict=True))
