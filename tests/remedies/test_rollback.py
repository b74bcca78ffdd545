"""`Snapshots` and `SkipWindow`: exact rollback of weights, optimizer, scheduler and RNG."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stabilizer.demo.model import GPT
from stabilizer.live.remedies import RollbackError, SkipWindow, Snapshots

from .helpers import optimizer_tensors, parameter_ids, tiny_gpt, train_steps

IN_MEMORY = {"max_memory_bytes": 1 << 30}
ON_DISK = {"max_memory_bytes": 0}  # every snapshot is bigger: it goes to the directory


def run_setup(**kwargs: Any) -> tuple[GPT, torch.optim.AdamW, Any, Snapshots]:
    model = tiny_gpt(dropout=0.1).train()  # dropout draws from the RNG the snapshot must restore
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=20)
    return model, optimizer, scheduler, Snapshots(model, optimizer, scheduler, **kwargs)


def step(model: GPT, optimizer: torch.optim.Optimizer, scheduler: Any, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        losses += train_steps(model, optimizer, 1)
        scheduler.step()
    return losses


def draws() -> tuple[float, float, float]:
    return float(torch.rand(())), float(np.random.rand()), random.random()


@pytest.mark.parametrize("where", [IN_MEMORY, ON_DISK], ids=["memory", "disk"])
def test_restore_is_exact_and_training_replays(where: dict[str, int], tmp_path: Path) -> None:
    model, optimizer, scheduler, snapshots = run_setup(directory=tmp_path, **where)
    step(model, optimizer, scheduler, 2)
    assert snapshots.save(2)
    assert snapshots.on_disk == (where is ON_DISK)
    assert (tmp_path / "snapshot-2.pt").exists() == (where is ON_DISK)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: v.clone() for k, v in optimizer_tensors(optimizer).items()}
    lr, ids = scheduler.get_last_lr(), parameter_ids(model)
    first = step(model, optimizer, scheduler, 3), draws()

    assert snapshots.restore() == 2
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    restored = optimizer_tensors(optimizer)
    assert restored.keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in restored.items())
    assert scheduler.get_last_lr() == lr and optimizer.param_groups[0]["lr"] == lr[0]
    assert parameter_ids(model) == ids
    # Same RNG, weights and optimizer: the next steps (dropout, batches) replay bit for bit.
    assert (step(model, optimizer, scheduler, 3), draws()) == first

    # The optimizer updated its state in place since: the snapshot must not have moved with it.
    assert snapshots.restore() == 2
    assert all(torch.equal(v, state[k]) for k, v in optimizer_tensors(optimizer).items())
    assert (step(model, optimizer, scheduler, 3), draws()) == first
    assert snapshots.restores == 2


def test_refuses_after_max_restores() -> None:
    *_, snapshots = run_setup(max_restores=1)
    with pytest.raises(RollbackError, match="no snapshot to restore"):
        snapshots.restore()
    snapshots.save(0)
    assert snapshots.can_restore()
    snapshots.restore()
    assert not snapshots.can_restore()
    with pytest.raises(RollbackError, match=r"`max_restores` \(1\) restores already done"):
        snapshots.restore()


def test_keeps_the_last_finite_state_only() -> None:
    model, *_, snapshots = run_setup(every=2)
    assert not snapshots.maybe_save(1)
    assert snapshots.maybe_save(2) and snapshots.step == 2
    good = model.lm_head.weight.detach().clone()
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    assert not snapshots.maybe_save(4)
    assert snapshots.step == 2
    assert snapshots.restore() == 2
    assert torch.equal(model.lm_head.weight, good)


def test_large_snapshot_without_directory_stays_in_memory(caplog: pytest.LogCaptureFixture) -> None:
    *_, snapshots = run_setup(max_memory_bytes=0)
    assert snapshots.save(0) and not snapshots.on_disk
    assert "kept in memory" in caplog.text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every": 0}, "`every` must be >= 1, got 0"),
        ({"max_restores": -1}, "`max_restores` must be >= 0, got -1"),
        ({"max_memory_bytes": -1}, "`max_memory_bytes` must be >= 0, got -1"),
    ],
    ids=["every", "max_restores", "max_memory_bytes"],
)
def test_rejects_bad_arguments(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run_setup(**kwargs)


def test_skip_window() -> None:
    window = SkipWindow()
    assert not window.active(0)
    assert window.start(10, 3) == 13
    assert [window.active(s) for s in (9, 10, 12, 13)] == [False, True, True, False]
    assert window.start(11, 1) == 13  # a shorter window does not cut the open one short
    with pytest.raises(ValueError, match="`count` must be >= 0, got -1"):
        window.start(0, -1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("where", [IN_MEMORY, ON_DISK], ids=["memory", "disk"])
def test_restore_on_cuda(where: dict[str, int], tmp_path: Path) -> None:
    model = tiny_gpt(dropout=0.1).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    snapshots = Snapshots(model, optimizer, directory=tmp_path, **where)

    def losses() -> list[float]:
        out = []
        for _ in range(2):
            idx = torch.randint(0, 64, (2, 8), device="cuda")  # drawn from the CUDA generator
            _, loss = model(idx, idx)
            assert loss is not None
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            out.append(float(loss.detach()))
        return out

    losses()
    assert snapshots.save(2)
    first = losses()
    assert snapshots.restore() == 2
    assert all(p.is_cuda for p in model.parameters())
    assert all(v.is_cuda for k, v in optimizer_tensors(optimizer).items() if k[1] != "step")
    assert losses() == first


@pytest.mark.parametrize("where", [IN_MEMORY, ON_DISK], ids=["memory", "disk"])
def test_restore_goes_back_before_the_trouble(where: dict[str, int], tmp_path: Path) -> None:
    # A divergence is reported long after it began: go back to a snapshot from before its start.
    model, optimizer, scheduler, _ = run_setup(directory=tmp_path, **where)
    snapshots = Snapshots(model, optimizer, every=1, keep=3, directory=tmp_path, **where)
    weights = {}
    for s in range(5):
        step(model, optimizer, scheduler, 1)
        assert snapshots.save(s)
        weights[s] = {k: v.clone() for k, v in model.state_dict().items()}
    assert snapshots.steps == [2, 3, 4]  # the oldest dropped
    assert len(list(tmp_path.glob("snapshot-*.pt"))) == (3 if where is ON_DISK else 0)
    assert not snapshots.can_restore(before=2)
    assert snapshots.restore(before=4) == 3
    assert all(torch.equal(v, weights[3][k]) for k, v in model.state_dict().items())
    assert snapshots.steps == [2, 3]  # the ones after it held the trouble
    with pytest.raises(RollbackError, match="no snapshot from before step 1"):
        snapshots.restore(before=1)
