"""Tests of the root-cause replay: faults injected deterministically into a tiny reference GPT."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from stabilizer.demo.model import GPT, GPTConfig
from stabilizer.live.locate import (
    Localization,
    locate_nonfinite,
    optimizer_produced_nonfinite,
)
from stabilizer.live.rng import RngState
from stabilizer.live.tensors import all_finite, optimizer_state_tensors
from stabilizer.step.own_findings import _finding

TINY = {"vocab_size": 64, "n_layer": 3, "n_head": 2, "n_embd": 16, "block_size": 8}


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_gpt(**overrides: Any) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**TINY, **overrides})).train()


def batch(seed: int = 1) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, TINY["vocab_size"], (2, TINY["block_size"]), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def step_of(model: nn.Module) -> Callable[[], Tensor]:
    """The closure a caller hands over: the failing step's forward, returning the loss."""
    idx, targets = batch()

    def run_step() -> Tensor:
        _, loss = model(idx, targets)
        assert loss is not None
        return loss

    return run_step


def scale_output(factor: float, times: int | None = None) -> Callable[..., Tensor | None]:
    """A forward hook multiplying the module's output by ``factor`` (the first ``times`` calls)."""
    calls = [0]

    def hook(module: nn.Module, args: Any, output: Tensor) -> Tensor | None:
        calls[0] += 1
        if times is not None and calls[0] > times:
            return None
        return output * factor

    return hook


class NaNGrad(torch.autograd.Function):
    """Identity forward; NaN gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad * math.nan


def no_hooks_left(model: nn.Module) -> bool:
    return all(
        not (m._forward_hooks or m._backward_hooks or m._forward_pre_hooks) for m in model.modules()
    )


@pytest.mark.parametrize(
    ("name", "factor"),
    [
        ("blocks.1.mlp", math.inf),
        ("blocks.1.mlp", math.nan),
        ("blocks.1.mlp.c_fc", math.inf),
        ("blocks.0.attn", math.nan),
        ("ln_f", math.inf),
    ],
    ids=["mlp-inf", "mlp-nan", "c_fc-inf", "attn-nan", "ln_f-inf"],
)
def test_forward_fault_names_the_module(name: str, factor: float) -> None:
    model = tiny_gpt()
    handle = model.get_submodule(name).register_forward_hook(scale_output(factor))
    loc = locate_nonfinite(model, step_of(model))
    handle.remove()
    assert (loc.phase, loc.module, loc.cause) == ("forward", name, "numerical")
    assert math.isfinite(loc.input_absmax) and loc.input_absmax > 0
    assert not math.isfinite(loc.output_absmax)
    assert not math.isfinite(loc.loss)
    assert loc.elapsed_s > 0
    assert no_hooks_left(model)


def test_forward_fault_in_a_parents_own_code_names_the_parent() -> None:
    # NaN made inside attention's own forward (not in a child): the innermost module holding
    # that code is the attention module, not its c_proj (whose input is already bad).
    model = tiny_gpt(attention="manual")
    attn = model.blocks[1].attn
    manual = attn._manual
    attn._manual = lambda *args: manual(*args) * math.nan  # type: ignore[method-assign]
    loc = locate_nonfinite(model, step_of(model))
    assert (loc.phase, loc.module) == ("forward", "blocks.1.attn")


def test_backward_fault_matches_detect_anomaly() -> None:
    model = tiny_gpt()
    applied_in: list[str] = []
    names = {m: n for n, m in model.named_modules()}

    def inject(module: nn.Module, args: Any, output: Tensor) -> Tensor:
        applied_in.append(names[module])
        return NaNGrad.apply(output)  # type: ignore[no-any-return]

    handle = model.blocks[2].attn.register_forward_hook(inject)
    run_step = step_of(model)
    anomaly = "Function 'NaNGradBackward' returned nan values in its 0th output"
    with (
        warnings.catch_warnings(record=True) as caught,
        pytest.raises(RuntimeError, match=anomaly),
        torch.autograd.detect_anomaly(),
    ):
        warnings.simplefilter("always")
        run_step().backward()
    # Anomaly mode's forward traceback: NaNGradBackward was created inside the attention call.
    traceback = next(str(w.message) for w in caught if "NaNGradBackward" in str(w.message))
    assert "self.attn(" in traceback
    model.zero_grad(set_to_none=True)
    loc = locate_nonfinite(model, run_step)
    handle.remove()
    assert applied_in == ["blocks.2.attn", "blocks.2.attn"]  # anomaly run, then our replay
    assert (loc.phase, loc.module, loc.cause) == ("backward", "blocks.2.attn", "numerical")
    assert math.isfinite(loc.input_absmax) and math.isnan(loc.output_absmax)
    assert math.isfinite(loc.loss)
    assert no_hooks_left(model)


def test_gradient_only_fault_names_the_parameter() -> None:
    # A weight gradient gone bad while every activation gradient stays finite.
    model = tiny_gpt()
    weight = model.blocks[0].mlp.c_fc.weight
    weight.register_hook(lambda g: g * math.inf)
    loc = locate_nonfinite(model, step_of(model))
    assert (loc.phase, loc.module, loc.parameter) == (
        "backward",
        "blocks.0.mlp.c_fc",
        "blocks.0.mlp.c_fc.weight",
    )


def test_transient_fault_is_not_reproduced() -> None:
    model = tiny_gpt()
    model.blocks[1].mlp.register_forward_hook(scale_output(math.nan, times=1))
    run_step = step_of(model)
    assert not math.isfinite(float(run_step().detach()))  # the training step itself failed
    loc = locate_nonfinite(model, run_step)
    assert (loc.reproduced, loc.cause, loc.phase, loc.module) == (False, "transient", "none", None)
    assert math.isfinite(loc.loss)
    assert "transient" in loc.message


def test_loss_only_and_bad_input_and_bad_weights() -> None:
    model = tiny_gpt()
    run_step = step_of(model)
    loc = locate_nonfinite(model, lambda: run_step() / 0.0)
    assert (loc.phase, loc.module, loc.reproduced) == ("loss", None, True)

    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.tensor([[1.0, math.nan, 0.0, 0.0]])
    assert locate_nonfinite(net, lambda: net(x).sum()).phase == "input"

    with torch.no_grad():
        model.blocks[2].mlp.c_proj.weight[0, 0] = math.inf
    loc = locate_nonfinite(model, run_step)
    assert (loc.phase, loc.module, loc.parameter) == (
        "weights",
        "blocks.2.mlp.c_proj",
        "blocks.2.mlp.c_proj.weight",
    )


def test_the_model_itself_is_named_by_its_forward() -> None:
    """#33: ``[<model>]`` named no code; a fault in the model's own ``forward`` (outside every
    submodule) names that forward."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x: Tensor) -> dict[str, Any]:
            return {"out": self.lin(x) / 0.0, "none": None, "ids": torch.arange(3)}

    model = Scaled()
    loc = locate_nonfinite(model, lambda: model(torch.ones(1, 3))["out"].sum())
    assert (loc.phase, loc.module) == ("forward", "Scaled.forward")
    assert loc.message.startswith("Scaled.forward produced NaN/Inf in the forward pass")


def test_grads_restored_bit_for_bit_and_hooks_removed() -> None:
    model = tiny_gpt(dropout=0.1)
    handle = model.blocks[1].mlp.register_forward_hook(scale_output(1e3))  # big, finite
    run_step = step_of(model)
    run_step().backward()
    model.blocks[0].ln_1.weight.grad = None  # a parameter without a gradient stays without
    before = {n: p.grad for n, p in model.named_parameters()}
    copies = {n: None if g is None else g.clone() for n, g in before.items()}
    handle.remove()
    model.blocks[1].mlp.register_forward_hook(scale_output(math.inf))
    loc = locate_nonfinite(model, run_step)
    assert loc.module == "blocks.1.mlp"
    for n, p in model.named_parameters():
        assert p.grad is before[n]
        if copies[n] is None:
            assert p.grad is None
        else:
            assert torch.equal(p.grad, copies[n])
    assert all(not m._backward_hooks for m in model.modules())
    assert sum(len(m._forward_hooks) for m in model.modules()) == 1  # only the test's own


def test_rng_replays_the_failing_steps_dropout_and_leaves_the_stream_alone() -> None:
    model = tiny_gpt(dropout=0.5)
    run_step = step_of(model)
    state = RngState.capture()
    loss = float(run_step().detach())
    torch.rand(3)  # the caller's stream moves on after the failing step
    later = torch.get_rng_state()
    loc = locate_nonfinite(model, run_step, rng_state=state)
    assert loc.loss == loss
    assert torch.equal(torch.get_rng_state(), later)
    assert locate_nonfinite(model, run_step).loss != loss  # another dropout mask


def test_inplace_output_ops_fall_back_to_forward_hooks() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
    net[2].register_forward_hook(scale_output(math.inf))
    loc = locate_nonfinite(net, lambda: net(torch.ones(2, 4)).sum())
    assert (loc.phase, loc.module) == ("forward", "2")
    assert no_hooks_left(net) is False  # the test's own hook is still there
    assert all(not m._backward_hooks for m in net.modules())


def test_all_finite() -> None:
    big = torch.full((400,), 60000.0, dtype=torch.float16)  # an L2 norm would overflow fp16
    assert all_finite([big, torch.ones(3), torch.arange(3), torch.empty(0)])
    assert all_finite([])
    assert not all_finite([torch.ones(3), torch.tensor([1.0, math.nan])])
    assert not all_finite([torch.tensor([-math.inf], dtype=torch.bfloat16)])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_optimizer_is_named_as_the_source(dtype: torch.dtype) -> None:
    # fp16 AdamW: eps=1e-8 rounds to 0 and grad**2 = 1e-10 underflows, so exp_avg / 0 = inf.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4)).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-8)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-5)
    before = all_finite(model.parameters())
    assert before and all_finite(p.grad for p in model.parameters() if p.grad is not None)
    optimizer.step()
    produced = optimizer_produced_nonfinite(before, model.parameters())
    assert produced is (dtype == torch.float16)
    states = list(optimizer_state_tensors(optimizer))
    assert len(states) == 6  # step, exp_avg, exp_avg_sq for weight and bias
    assert all_finite(states)  # the moments stay finite: only the update divided by zero
    if produced:
        loc = locate_nonfinite(model, lambda: model(torch.ones(1, 4, dtype=dtype)).sum())
        assert (loc.phase, loc.module, loc.parameter) == ("weights", "0", "0.weight")
        assert "non-finite before the step" in loc.message  # no blame it cannot prove


def test_replay_runs_with_gradients_even_under_no_grad() -> None:
    model = tiny_gpt()
    model.blocks[0].mlp.c_fc.weight.register_hook(lambda g: g * math.nan)
    with torch.no_grad():
        loc = locate_nonfinite(model, step_of(model))
    assert (loc.phase, loc.parameter) == ("backward", "blocks.0.mlp.c_fc.weight")
    assert "every activation gradient is finite" in loc.message


@pytest.mark.parametrize(
    ("scale", "phase", "module"), [(1.0, "none", None), (3e4, "backward", "1")]
)
def test_loss_scale_reproduces_an_fp16_gradient_overflow(
    scale: float, phase: str, module: str | None
) -> None:
    # GradScaler's scale 3e4 flows in finite; 4.0 * 3e4 = 1.2e5 overflows fp16 (max 65504).
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)).half()
    with torch.no_grad():
        net[1].weight.fill_(4.0)
    x = torch.ones(1, 4, dtype=torch.float16)
    loc = locate_nonfinite(net, lambda: net(x).float().sum(), loss_scale=scale)
    assert (loc.phase, loc.module) == (phase, module)
    if module is not None:
        assert loc.input_absmax == 3e4 and loc.output_absmax == math.inf


@pytest.mark.parametrize("scale", [0.0, -1.0, math.inf, math.nan])
def test_loss_scale_must_be_positive(scale: float) -> None:
    with pytest.raises(ValueError, match="`loss_scale` must be finite and > 0, got"):
        locate_nonfinite(nn.Linear(1, 1), lambda: torch.zeros(()), loss_scale=scale)


def test_localization_evidence_is_floats() -> None:
    loc = Localization("forward", "blocks.0", input_absmax=1.0, output_absmax=math.inf)
    assert loc.evidence["output_absmax"] == math.inf
    assert loc.evidence["reproduced"] == 1.0
    assert "blocks.0" in loc.message


def test_the_finding_of_a_nan_made_in_the_loss_points_at_the_loss_code() -> None:
    loss_only = _finding(7, Localization(phase="loss", module=None, loss=math.nan))
    assert "loss computation" in loss_only.message and "deterministic" in loss_only.message
    assert "numerical" not in loss_only.message and loss_only.remedies == ("skip_step",)
    assert loss_only.location == ()

    forward = _finding(7, Localization(phase="forward", module="model.blocks.1.mlp"))
    assert forward.location == ("blocks.1.mlp",) and "model." not in forward.message
    assert "numerical fault" in forward.message and "upcast_to_fp32" in forward.remedies


def test_a_nan_weight_no_module_used_is_not_the_cause() -> None:
    # An unused parameter holding NaN (a stale init): the NaN of the loss comes from elsewhere.
    net = nn.ModuleDict({"used": nn.Linear(4, 1), "unused": nn.Linear(2, 2)})
    with torch.no_grad():
        net["unused"].weight.fill_(math.nan)
    x = torch.ones(1, 4)
    loc = locate_nonfinite(net, lambda: net["used"](x).sum() / 0.0 * 0.0)
    assert loc.phase == "loss"


def test_a_nan_batch_is_the_input_whichever_module_sees_it_first() -> None:
    # The batch goes through a submodule (the LightningModule's `self.net(x)`), never the root.
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))

    wrapper = Wrapper()
    x = torch.tensor([[1.0, math.nan, 0.0, 0.0]])
    loc = locate_nonfinite(wrapper, lambda: wrapper.net(x).sum(), inputs=(x, torch.zeros(1)))
    assert (loc.phase, loc.message) == ("input", "the input batch holds NaN/Inf")


class MaskedAttention(nn.Module):
    """``nn.MultiheadAttention`` fed PyTorch's float causal mask and a float padding mask
    (``-inf`` by design), as its docs write it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 16)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(6))

    def forward(self, ids: Tensor) -> Tensor:
        pad = torch.zeros(ids.shape).masked_fill(ids == 0, -math.inf)
        h = self.embed(ids)
        out, _ = self.attn(h, h, h, attn_mask=self.mask, key_padding_mask=pad)
        logits: Tensor = self.head(out)
        return logits


def test_a_module_fed_a_minus_inf_mask_is_still_named() -> None:
    # Its inputs hold -inf (the masks): they are no NaN/Inf it took in, so the NaN it makes
    # is its own (it was blamed on the whole model).
    torch.manual_seed(0)
    model = MaskedAttention()
    model.attn.register_forward_hook(lambda m, a, out: (out[0] * math.nan, out[1]))
    ids = torch.randint(1, 16, (2, 6))
    where = locate_nonfinite(
        model, lambda: nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    )
    assert (where.phase, where.module) == ("forward", "attn")
    inputs = {"ids": ids, "mask": model.mask}  # a batch that carries a float mask is no NaN batch
    assert locate_nonfinite(model, lambda: model(ids).sum(), inputs=inputs).phase == "forward"
