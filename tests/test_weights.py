"""`WeightsWatch`'s fast test before a step: what it covers at each step (all of the optimizer
state, the parameters an eighth in turn on the CPU), and the positions held by design."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from stabilizer.step.weights import CPU_SHARES, WeightsWatch

CPU = torch.device("cpu")


def stepped() -> tuple[nn.Module, torch.optim.Optimizer, WeightsWatch]:
    """A small model whose AdamW has stepped once (its moments exist), and its watch."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(CPU_SHARES)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    watch = WeightsWatch(model)
    watch.begin([opt], 0)
    return model, opt, watch


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq", "step"])
def test_the_whole_optimizer_state_is_tested_at_every_step(key: str) -> None:
    model, opt, watch = stepped()
    assert all(float(watch.check(opt, step, CPU)) == 0 for step in range(CPU_SHARES))
    last = list(model.parameters())[-1]
    opt.state[last][key].fill_(math.nan)  # written outside the step (a callback)
    assert all(float(watch.check(opt, step, CPU)) > 0 for step in range(CPU_SHARES))


def test_the_parameters_are_tested_an_eighth_in_turn_on_the_cpu() -> None:
    _, opt, watch = stepped()
    params = [p for g in opt.param_groups for p in g["params"]]
    with torch.no_grad():
        params[5].view(-1)[0] = math.inf
    found = [step for step in range(2 * CPU_SHARES) if float(watch.check(opt, step, CPU)) > 0]
    assert found == [5, 5 + CPU_SHARES]  # within CPU_SHARES steps, whatever the phase


def test_positions_held_by_design_are_not_judged_and_a_new_one_is() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    with torch.no_grad():
        model.bias[0] = -math.inf  # held by design when first seen: a mask
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    watch = WeightsWatch(model)
    (note,) = watch.begin([opt], 0)
    assert note.kind == "nonfinite_held"
    tested, counted = watch.to_check(opt, 1)  # the bias is in the share of step 1
    assert all(t is not model.bias for t in tested) and counted is not None
    assert float(watch.check(opt, 1, CPU)) == 0
    with torch.no_grad():
        model.bias[1] = math.nan  # a position that was finite
    assert float(watch.check(opt, 1, CPU)) > 0
