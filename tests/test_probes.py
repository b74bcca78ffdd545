"""`GradProbe`: per-group gradient norms, and their combination over sharded ranks (FSDP)."""

from __future__ import annotations

import math

import torch

from stabilizer.demo.config import GPTConfig
from stabilizer.demo.model import GPT
from stabilizer.live.probes import GradProbe


def model_with_grads() -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))
    idx = torch.randint(0, 256, (2, 16))
    _, loss = model(idx, idx)
    assert loss is not None
    loss.backward()
    return model


def test_norms_match_torch() -> None:
    model = model_with_grads()
    probe = GradProbe(model)
    values = dict(zip(probe.keys, probe().tolist(), strict=True))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    assert abs(values["grad_norm"] - float(total)) < 1e-4 * float(total)
    assert values["nonfinite_grads"] == 0.0
    block0 = [p.grad for n, p in model.named_parameters() if n.startswith("blocks.0.")]
    expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in block0 if g is not None]))
    assert abs(values["grad_norm/block_00"] - float(expected)) < 1e-4 * float(expected)


def test_sharded_norms_combine_to_the_full_norms() -> None:
    # FSDP: each rank holds a shard of every gradient. Emulate two ranks by keeping either half
    # of each gradient's elements; their squares summed over ranks give the unsharded norms.
    model = model_with_grads()
    full_probe = GradProbe(model)
    full = full_probe()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    ranks = []
    for rank in (0, 1):
        for n, p in model.named_parameters():
            flat = grads[n].flatten().clone()
            half = flat.numel() // 2
            if rank == 0:
                flat[half:] = 0
            else:
                flat[:half] = 0
            p.grad = flat.view_as(p)
        ranks.append(GradProbe.sharded_squares(GradProbe(model)()))
    combined = GradProbe.from_squares(ranks[0] + ranks[1])
    assert torch.allclose(combined, full, rtol=1e-5)
    assert GradProbe.from_squares(GradProbe.sharded_squares(full)).allclose(full, rtol=1e-6)


def test_a_group_without_any_gradient_is_gradless_not_zero() -> None:
    # Post-LN never calls the final norm, the head group's only own parameters (the output
    # matrix is tied to the embedding): no gradient, which the monitor must not log as 0.
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, norm_position="post"))
    probe = GradProbe(model)
    idx = torch.randint(0, 256, (2, 16))
    _, loss = model(idx, idx)
    assert loss is not None
    loss.backward()
    probe()
    assert model.ln_f.weight.grad is None
    assert probe.gradless == {"grad_norm/head"}
    assert "grad_norm/block_00" in probe.keys and "grad_norm/head" in probe.keys

    pre = model_with_grads()  # pre-LN: the final norm runs
    probe = GradProbe(pre)
    probe()
    assert probe.gradless == set()


def _probe_of(*grads: torch.Tensor) -> dict[str, float]:
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    module = torch.nn.Module()
    for i, p in enumerate(params):
        module.register_parameter(f"p{i}", p)
    probe = GradProbe(module)
    return dict(zip(probe.keys, probe().tolist(), strict=True))


def test_a_huge_finite_gradient_is_finite() -> None:
    # 1e20 squared overflows float32: the norms are accumulated in float64.
    values = _probe_of(torch.full((4,), 1e20))
    assert values["nonfinite_grads"] == 0.0
    assert abs(values["grad_norm"] - 2e20) < 1e14


def test_fp64_and_complex_gradients_are_checked_exactly() -> None:
    finite = _probe_of(
        torch.tensor([3.0, 4.0], dtype=torch.float64) * 1e200,
        torch.tensor([3 + 4j], dtype=torch.complex64),
    )
    assert finite["nonfinite_grads"] == 0.0
    bad = _probe_of(
        torch.tensor([1.0, math.inf], dtype=torch.float64),
        torch.tensor([complex(math.nan, 0.0)], dtype=torch.complex64),
        torch.ones(2, dtype=torch.bfloat16),
    )
    assert bad["nonfinite_grads"] == 2.0
    assert _probe_of(torch.tensor([3 + 4j], dtype=torch.complex64))["grad_norm"] == 5.0


def test_untouched_sees_in_place_writes_and_new_gradients() -> None:
    layer = torch.nn.Linear(2, 2)
    layer(torch.ones(1, 2)).sum().backward()
    probe = GradProbe(layer)
    probe()
    assert probe.untouched()
    assert layer.weight.grad is not None
    layer.weight.grad.mul_(2.0)  # a clipping hook
    assert not probe.untouched()
    probe()
    layer.bias.grad = torch.zeros(2)  # a new gradient object
    assert not probe.untouched()


def test_the_weights_fast_test_rides_on_every_path_of_the_probe() -> None:
    # The fast path (one pass over the gradients and the checked tensors), gradients the fast
    # path cannot take (two dtypes: the device path), and no gradient at all: the same answer,
    # one value past the keys, and the norms as without a check.
    model = model_with_grads()
    probe = GradProbe(model)
    plain = probe()
    bad, good = [torch.ones(3), torch.tensor(math.nan)], [torch.ones(3), torch.tensor(2.0)]
    for check, want in ((good, 0.0), (bad, 1.0)):
        out = probe(check)
        assert out[:-1].tolist() == plain.tolist() and (out[-1] > 0) == (want > 0)
    bias = model.ln_f.bias
    bias.grad_dtype = None  # two dtypes among the gradients
    bias.grad = bias.grad.double()  # type: ignore[union-attr]
    assert probe(bad)[-1] > 0 and probe(good)[-1] == 0 and len(probe(good)) == len(probe.keys) + 1
    model.zero_grad(set_to_none=True)  # no gradient at all
    assert probe(bad)[-1] > 0 and probe(good)[-1] == 0
    assert probe(good)[:-1].tolist() == [0.0] * len(probe.keys)
