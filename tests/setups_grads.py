"""Round 6's setups that write the gradients or the optimizer step their own way, in a plain
loop (`Stabilizer`) and Fabric, each as a user writes it (the frame: `setups_loop`)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from setups_harness import Ctx, Net, mse
from setups_loop import Loop, adamw, frame, simple
from torch import Tensor, nn

from stabilizer.hosts.loop import Stabilizer


def clip_value(ctx: Ctx) -> Any:
    """The loop clips each gradient's values itself, after telling the Stabilizer."""
    net = Net()
    ctx.nan(net.a)
    opt = adamw(net)

    def body(loop: Loop, x: Tensor, y: Tensor) -> None:
        loop.backward(mse(net(x), y))
        loop.before_step(opt)
        nn.utils.clip_grad_value_(net.parameters(), 0.1)
        opt.step()
        opt.zero_grad()

    return frame(ctx, net, opt, body)


def autograd_grad(ctx: Ctx) -> Any:
    """Gradients from ``torch.autograd.grad``, assigned to ``.grad`` (no ``backward``)."""
    net = Net()
    ctx.nan(net.a)
    opt = adamw(net)
    params = list(net.parameters())

    def body(loop: Loop, x: Tensor, y: Tensor) -> None:
        grads = torch.autograd.grad(mse(net(x), y), params)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
        opt.zero_grad()

    return frame(ctx, net, opt, body)


def gradient_penalty(ctx: Ctx) -> Any:
    """A loss with a gradient penalty (``create_graph=True``: a double backward)."""
    net = Net()
    ctx.nan(net.a)
    opt = adamw(net)

    def body(loop: Loop, x: Tensor, y: Tensor) -> None:
        x = x.requires_grad_(True)
        out = net(x)
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        loop.backward(mse(out, y) + 0.1 * (gx.norm(dim=1) - 1).pow(2).mean())
        opt.step()
        opt.zero_grad()

    return frame(ctx, net, opt, body)


def two_backwards(ctx: Ctx) -> Any:
    """Two losses of one forward, each backpropagated (``retain_graph=True`` on the first)."""
    net = Net()
    ctx.nan(net.a)
    opt = adamw(net)

    def body(loop: Loop, x: Tensor, y: Tensor) -> None:
        out = net(x)
        loop.backward(mse(out, y), retain_graph=True)
        loop.backward(0.01 * out.abs().mean())
        opt.step()
        opt.zero_grad()

    return frame(ctx, net, opt, body)


def data_parallel(ctx: Ctx) -> Any:
    """``nn.DataParallel`` on the CPU (it calls the module itself)."""
    net = Net()
    ctx.nan(net.a)
    return simple(ctx, nn.DataParallel(net), adamw(net), watch=net)


def muon_and_adamw(ctx: Ctx) -> Any:
    """Muon for the 2-D weights, AdamW for the rest (modded-nanoGPT's split)."""
    net = Net()
    ctx.nan(net.a)
    matrices = [p for p in net.parameters() if p.dim() == 2]
    rest = [p for p in net.parameters() if p.dim() != 2]
    muon, adam = torch.optim.Muon(matrices, lr=1e-2), torch.optim.AdamW(rest, lr=1e-2)

    def body(loop: Loop, x: Tensor, y: Tensor) -> None:
        loop.backward(mse(net(x), y))
        for opt in (muon, adam):
            opt.step()
        net.zero_grad(set_to_none=True)

    return frame(ctx, net, [muon, adam], body)


def warmup_unlisted(ctx: Ctx) -> Any:
    """A ``LambdaLR`` warmup the user does not tell the Stabilizer of."""
    net = Net()
    ctx.nan(net.a)
    opt = adamw(net)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return simple(ctx, net, opt, after_step=lambda i, loss: sched.step())


def zero_redundancy(ctx: Ctx) -> Any:
    """``ZeroRedundancyOptimizer`` in a one-process gloo group."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        net = Net()
        ctx.nan(net.a)
        opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW, lr=1e-2)
        return simple(ctx, net, opt)
    finally:
        dist.destroy_process_group()


def bf16_weights(ctx: Ctx) -> Any:
    """The model itself in bf16 (``model.to(torch.bfloat16)``), AdamW on bf16 weights."""
    net = Net().to(torch.bfloat16)
    ctx.nan(net.a)
    opt = adamw(net)

    def body(loop: Loop, x: Tensor, y: Tensor) -> None:
        loop.backward(mse(net(x.bfloat16()), y))
        opt.step()
        opt.zero_grad()

    return frame(ctx, net, opt, body, precision="bf16-true")


def accumulate_nan_middle(ctx: Ctx) -> Any:
    """Gradient accumulation over 3 micro-batches; the middle one is NaN."""
    net = Net()
    ctx.nan(net.a)
    opt = adamw(net)
    loop = Loop(ctx, net, opt, clip=1.0)
    data = ctx.batches(accumulate=3)
    for i in range(len(data) // 3):
        with loop.step():
            for x, y in data[3 * i : 3 * i + 3]:
                ctx.begin(i, [net], [opt])
                loop.backward(mse(net(x), y) / 3)
            if loop.stab is None:
                nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    ctx.finish([net], [opt])
    return loop.close()


def accumulate_across_blocks(ctx: Ctx) -> Any:
    """A block per micro-batch, stepping every second one (the loop accumulates across its
    blocks, as Lightning's manual optimization does); a NaN input in step 3's first."""
    net = Net()
    opt = adamw(net)
    loop = Loop(ctx, net, opt)
    for i, (x, y) in enumerate(ctx.batches(accumulate=2, nan_input=True)):
        ctx.begin(i // 2, [net], [opt])
        with loop.step():
            loss = mse(net(x), y) / 2
            ctx.losses.append(float(loss))
            loop.backward(loss)
            if i % 2 == 1:
                opt.step()
                opt.zero_grad()
    ctx.finish([net], [opt])
    return loop.close()


# --- Fabric ---------------------------------------------------------------------------------


def fabric_run(
    precision: str, accumulate: int = 1, clip: bool = False, compile: bool = False
) -> Any:
    def run(ctx: Ctx) -> Any:
        from lightning.fabric import Fabric

        fabric = Fabric(accelerator="cpu", devices=1, precision=precision)  # type: ignore[arg-type]
        net = Net()
        ctx.nan(net.a)
        torch._dynamo.reset()
        given = torch.compile(net, backend="eager") if compile else net
        model, opt = fabric.setup(given, adamw(net))
        stab = Stabilizer(model, opt, fabric=fabric, jsonl=ctx.jsonl) if ctx.monitored else None
        data = ctx.batches(accumulate=accumulate)
        for i in range(len(data) // accumulate):
            with stab.step() if stab is not None else contextlib.nullcontext():
                for j, (x, y) in enumerate(data[accumulate * i : accumulate * (i + 1)]):
                    ctx.begin(i, [net], [opt])
                    last = j == accumulate - 1
                    with fabric.no_backward_sync(model, enabled=not last):
                        loss = mse(model(x), y) / accumulate
                        (stab.backward if stab is not None else fabric.backward)(loss)
                if clip:
                    if stab is not None:
                        stab.before_step(opt)
                    # (Fabric raises on a non-finite norm unless told not to: with or without us)
                    fabric.clip_gradients(model, opt, max_norm=0.5, error_if_nonfinite=False)
                opt.step()
                opt.zero_grad()
        ctx.finish([net], [opt])
        if stab is not None:
            stab.close()
        return stab

    return run


GRADS = {
    "clip_grad_value": clip_value,
    "autograd-grad-assigned": autograd_grad,
    "gradient-penalty": gradient_penalty,
    "two-backwards-retain_graph": two_backwards,
    "data-parallel-cpu": data_parallel,
    "muon-and-adamw": muon_and_adamw,
    "warmup-not-told": warmup_unlisted,
    "zero-redundancy-optimizer": zero_redundancy,
    "bf16-weights": bf16_weights,
    "accumulate-nan-middle": accumulate_nan_middle,
    "accumulate-across-blocks": accumulate_across_blocks,
    "fabric-bf16-mixed": fabric_run("bf16-mixed"),
    "fabric-accumulate-no_backward_sync": fabric_run("32-true", accumulate=2),
    "fabric-clip_gradients": fabric_run("32-true", clip=True),
    "fabric-compile-eager": fabric_run("32-true", compile=True),
}
