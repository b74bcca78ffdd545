"""`LRMultiplier`: effective LR = scheduler LR × factor at every step, never compounding."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, LRScheduler, StepLR

from stabilizer.live.remedies import FactorChange, LRMultiplier

from .helpers import assert_same_optimizer_state, clone_state, parameter_ids

STEPS = 12

SCHEDULERS: dict[str, Callable[[Optimizer], LRScheduler]] = {
    # Chainable: computes each LR from the one in the param group, which a naive scale corrupts.
    "cosine_annealing": lambda opt: CosineAnnealingLR(opt, T_max=STEPS),
    "lambda_cosine": lambda opt: LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / STEPS))),
    "step": lambda opt: StepLR(opt, step_size=3, gamma=0.5),
}


def setup(
    make: Callable[[Optimizer], LRScheduler],
) -> tuple[torch.nn.Linear, Optimizer, LRScheduler]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(
        [{"params": [model.weight]}, {"params": [model.bias], "lr": 0.1}], lr=0.01
    )
    return model, optimizer, make(optimizer)


def run(
    make: Callable[[Optimizer], LRScheduler], multiplier: LRMultiplier | None
) -> tuple[list[list[float]], list[list[float]]]:
    """Per step: the LRs the optimizer stepped with, and the scheduler's last LRs after it."""
    model, optimizer, scheduler = setup(make)
    if multiplier is not None:
        multiplier.attach(optimizer)
    used: list[list[float]] = []
    # Registered after the multiplier's own pre-hook, so it sees the LR the step uses.
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: used.append([g["lr"] for g in opt.param_groups])
    )
    scheduled = []
    for _ in range(STEPS):
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        scheduled.append(scheduler.get_last_lr())
    return used, scheduled


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_effective_lr_is_scheduler_lr_times_factor(name: str) -> None:
    reference_used, reference_scheduled = run(SCHEDULERS[name], None)
    multiplier = LRMultiplier()
    assert multiplier.scale(0.5) == FactorChange(1.0, 0.5)
    used, scheduled = run(SCHEDULERS[name], multiplier)
    assert scheduled == reference_scheduled  # the scheduler never sees a scaled LR
    for step, (lrs, reference) in enumerate(zip(used, reference_used, strict=True)):
        assert lrs == pytest.approx([0.5 * lr for lr in reference], rel=1e-12), step


def test_naive_scaling_compounds_with_a_chainable_scheduler() -> None:
    """Why the multiplier scales only inside the step: a chainable scheduler computes the next LR
    from the group's, so a factor written into the group after each scheduler step compounds."""
    reference_used, _ = run(SCHEDULERS["cosine_annealing"], None)
    _, optimizer, scheduler = setup(SCHEDULERS["cosine_annealing"])
    for _ in range(4):
        optimizer.step()
        scheduler.step()
        for group in optimizer.param_groups:
            group["lr"] *= 0.5
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5**4 * reference_used[4][0])


def test_warmup_ramps_linearly_then_holds() -> None:
    multiplier = LRMultiplier()
    multiplier.scale(0.5)
    assert multiplier.warmup(4) == FactorChange(0.5, 0.125, 4)
    used, _ = run(lambda opt: LambdaLR(opt, lambda s: 1.0), multiplier)
    factors = [lrs[0] / 0.01 for lrs in used[:6]]
    assert factors == pytest.approx([0.125, 0.25, 0.375, 0.5, 0.5, 0.5])
    assert multiplier.factor == 0.5


def test_keeps_parameters_and_optimizer_state() -> None:
    model, optimizer, _ = setup(SCHEDULERS["cosine_annealing"])
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    ids, state = parameter_ids(model), clone_state(optimizer)
    lrs = [g["lr"] for g in optimizer.param_groups]
    multiplier = LRMultiplier()
    multiplier.attach(optimizer)
    multiplier.scale(0.5)
    multiplier.warmup(3)
    assert parameter_ids(model) == ids
    assert_same_optimizer_state(optimizer, state)
    assert [g["lr"] for g in optimizer.param_groups] == lrs  # outside a step, the scheduler's LR
    multiplier.detach()
    optimizer.step()
    assert [g["lr"] for g in optimizer.param_groups] == lrs


def test_manual_apply_restore_and_state_dict() -> None:
    _, optimizer, _ = setup(SCHEDULERS["step"])
    multiplier = LRMultiplier(0.5)
    multiplier.restore(optimizer)  # nothing applied: a no-op
    multiplier.apply(optimizer)
    multiplier.apply(optimizer)  # applying twice does not compound
    assert [g["lr"] for g in optimizer.param_groups] == [0.005, 0.05]
    multiplier.restore(optimizer)
    assert [g["lr"] for g in optimizer.param_groups] == [0.01, 0.1]
    multiplier.warmup(10)
    multiplier.apply(optimizer)
    multiplier.restore(optimizer)
    copy = LRMultiplier()
    copy.load_state_dict(multiplier.state_dict())
    assert copy.factor == multiplier.factor == pytest.approx(0.5 * 2 / 10)


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="`factor` must be > 0, got 0"):
        LRMultiplier(0.0)
    with pytest.raises(ValueError, match=r"`factor` must be > 0, got -0\.5"):
        LRMultiplier().scale(-0.5)
    with pytest.raises(ValueError, match="`steps` must be >= 1, got 0"):
        LRMultiplier().warmup(0)
