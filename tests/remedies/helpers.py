"""Tiny models and optimizer-state checks shared by the remedy tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from stabilizer.demo.model import GPT, GPTConfig

TINY: dict[str, Any] = {"vocab_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 16}


def tiny_gpt(seed: int = 0, **overrides: Any) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **overrides})).eval()


def tokens(batch: int = 2, length: int = 8, seed: int = 1) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY["vocab_size"], (batch, length), generator=generator)


def train_steps(model: GPT, optimizer: torch.optim.Optimizer, steps: int = 2) -> list[float]:
    """A few AdamW steps on random tokens (drawn from the global RNG), so state exists."""
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, TINY["vocab_size"], (2, 8))
        _, loss = model(idx, idx)
        assert loss is not None
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def trained_gpt(**overrides: Any) -> tuple[GPT, torch.optim.AdamW]:
    model = tiny_gpt(**overrides)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_steps(model.train(), optimizer)
    return model.eval(), optimizer


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[tuple[int, str], Tensor]:
    """Every optimizer state tensor (exp_avg, exp_avg_sq, step), by parameter id and name."""
    return {
        (id(p), key): value
        for p, state in optimizer.state.items()
        for key, value in state.items()
        if isinstance(value, Tensor)
    }


def clone_state(optimizer: torch.optim.Optimizer) -> dict[tuple[int, str], tuple[int, Tensor]]:
    """Each optimizer state tensor's identity and a copy of its value."""
    return {key: (id(value), value.clone()) for key, value in optimizer_tensors(optimizer).items()}


def assert_same_optimizer_state(
    optimizer: torch.optim.Optimizer, before: dict[tuple[int, str], tuple[int, Tensor]]
) -> None:
    """The state holds the very same tensor objects as `before`, with unchanged values."""
    now = optimizer_tensors(optimizer)
    assert now and now.keys() == before.keys()
    for key, value in now.items():
        assert id(value) == before[key][0], key
        assert torch.equal(value, before[key][1]), key


def parameter_ids(model: nn.Module) -> list[int]:
    return [id(p) for p in model.parameters()]
