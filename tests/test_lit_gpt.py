"""``LitGPT``'s optimizers: AdamW (the default) or SGD with momentum, as the scenario says."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch

from stabilizer.callbacks.demo.lit_gpt import LitGPT
from stabilizer.callbacks.demo.run import run_scenario
from stabilizer.demo.config import GPTConfig

_TINY = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8)


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> Iterator[None]:
    yield


def _optimizer(module: LitGPT) -> torch.optim.Optimizer:
    built = module.configure_optimizers()
    optimizer: torch.optim.Optimizer = built["optimizer"]
    return optimizer


def test_adamw_is_the_default_and_decays_matrices_only() -> None:
    opt = _optimizer(LitGPT(_TINY, lr=1e-3, weight_decay=0.1))
    assert type(opt) is torch.optim.AdamW
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() >= 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() < 2 for p in no_decay["params"])


def test_sgd_steps_by_the_gradient_times_the_lr() -> None:
    torch.manual_seed(0)
    module = LitGPT(_TINY, lr=0.5, weight_decay=0.0, optimizer="sgd", momentum=0.9)
    opt = _optimizer(module)
    assert type(opt) is torch.optim.SGD
    assert all(g["momentum"] == 0.9 and not g["nesterov"] for g in opt.param_groups)
    idx = torch.randint(0, _TINY.vocab_size, (2, 8))
    _, loss = module.model(idx, idx)
    assert loss is not None
    loss.backward()
    before = {p: (p.detach().clone(), p.grad.clone()) for p in module.parameters()}
    opt.step()  # the first step: the momentum buffer is the gradient itself
    for p, (w, g) in before.items():
        torch.testing.assert_close(p.detach(), w - 0.5 * g)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"optimizer": "lion"}, "`optimizer` must be one of adamw, sgd, got 'lion'"),
        ({"momentum": 1.0}, r"`momentum` must be in \[0, 1\), got 1.0"),
    ],
)
def test_bad_optimizer_settings_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LitGPT(_TINY, **kwargs)  # type: ignore[arg-type]


def test_a_scenario_trains_with_its_optimizer() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = run_scenario("spike-sgd", steps=2, accelerator="cpu", validate=False)
    (opt,) = run.trainer.optimizers
    assert type(opt) is torch.optim.SGD and opt.param_groups[0]["momentum"] == 0.9
    assert run.trainer.global_step == 2
