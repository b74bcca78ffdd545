"""Round 6's setups in a plain loop (`Stabilizer`) and Fabric, each as a user writes it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from setups_harness import NAN_AT, Ctx, Net, mse
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from stabilizer.hosts.loop import Stabilizer


class Loop:
    """A plain loop's few added lines, or nothing of them without the monitor."""

    def __init__(self, ctx: Ctx, model: nn.Module, optimizers: Any, **kwargs: Any) -> None:
        self.stab = (
            Stabilizer(model, optimizers, jsonl=ctx.jsonl, **kwargs) if ctx.monitored else None
        )

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        if self.stab is None:
            yield
        else:
            with self.stab.step():
                yield

    def backward(self, loss: Tensor, **kwargs: Any) -> None:
        if self.stab is not None:
            self.stab.backward(loss, **kwargs)
        else:
            loss.backward(**kwargs)

    def before_step(self, optimizer: Any) -> None:
        if self.stab is not None:
            self.stab.before_step(optimizer)

    def close(self) -> Stabilizer | None:
        if self.stab is not None:
            self.stab.close()
        return self.stab


Body = Callable[[Loop, Tensor, Tensor], None]


def frame(
    ctx: Ctx,
    model: nn.Module,
    optimizers: Any,
    body: Body,
    *,
    watch: nn.Module | None = None,
    nan_input: bool = False,
    **kwargs: Any,
) -> Stabilizer | None:
    """The loop around a setup's own code: a ``with stab.step()`` block per batch, `body(loop,
    x, y)` inside it (what the setup writes), the context told each step."""
    opts = list(optimizers) if isinstance(optimizers, list | tuple) else [optimizers]
    loop = Loop(ctx, model, optimizers, **kwargs)
    watched = [watch or model]
    for i, (x, y) in enumerate(ctx.batches(nan_input=nan_input)):
        ctx.begin(i, watched, opts)
        with loop.step():
            body(loop, x, y)
    ctx.finish(watched, opts)
    return loop.close()


def simple(
    ctx: Ctx,
    model: nn.Module,
    optimizer: Any,
    *,
    after_step: Any = None,
    zero: Any = None,
    **kwargs: Any,
) -> Stabilizer | None:
    """The plainest loop: forward, backward, step, zero_grad; `after_step(i, loss)` after."""
    at = {"i": 0}

    def body(loop: Loop, x: Tensor, y: Tensor) -> None:
        loss = mse(model(x), y)
        loop.backward(loss)
        optimizer.step()
        (zero or optimizer.zero_grad)()
        if after_step is not None:
            after_step(at["i"], loss)
        at["i"] += 1

    return frame(ctx, model, optimizer, body, **kwargs)


def adamw(model: nn.Module, **kwargs: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, **kwargs)


# --- the setups ----------------------------------------------------------------------------


def compiled(backend: str) -> Any:
    def run(ctx: Ctx) -> Any:
        torch._dynamo.reset()
        net = Net()
        model = torch.compile(net, backend=backend)
        return simple(ctx, model, adamw(net), watch=net, nan_input=True)

    return run


class Checkpointed(Net):
    """Net whose hidden block runs under activation checkpointing."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant

    def _hidden(self, x: Tensor) -> Tensor:
        return nn.functional.gelu(self.norm(self.a(x)))

    def forward(self, x: Tensor) -> Tensor:
        h = checkpoint(self._hidden, x, use_reentrant=self.reentrant)
        out: Tensor = self.b(h)
        return out


def checkpointed(reentrant: bool) -> Any:
    def run(ctx: Ctx) -> Any:
        net = Checkpointed(reentrant)
        ctx.nan(net.a)
        return simple(ctx, net, adamw(net))

    return run


def onecycle(ctx: Ctx) -> Any:
    net = Net()
    ctx.nan(net.a)
    opt = adamw(net)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
    return simple(ctx, net, opt, after_step=lambda i, loss: sched.step(), schedulers=[sched])


def plateau(ctx: Ctx) -> Any:
    """``ReduceLROnPlateau`` stepped on each step's loss (a NaN one too: the user's code)."""
    net = Net()
    ctx.nan(net.a)
    opt = adamw(net)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    return simple(ctx, net, opt, after_step=lambda i, loss: sched.step(float(loss)))


def ema(ctx: Ctx) -> Any:
    """An EMA copy (``AveragedModel``) updated after every step; it is trained on, not guarded."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    net = Net(bn=True)
    ctx.nan(net.a)
    averaged = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    opt = adamw(net)
    stab = simple(ctx, net, opt, after_step=lambda i, loss: averaged.update_parameters(net))
    ctx.final += [p.detach().clone() for p in averaged.parameters()]
    return stab


def swa(ctx: Ctx) -> Any:
    """SWA: ``SWALR`` and an ``AveragedModel`` from step 2, its BatchNorm statistics
    recomputed at the end (``update_bn`` runs the model outside any step)."""
    from torch.optim.swa_utils import SWALR, AveragedModel, update_bn

    net = Net(bn=True)
    ctx.nan(net.a)
    averaged = AveragedModel(net)
    opt = adamw(net)
    swalr = SWALR(opt, swa_lr=5e-3, anneal_epochs=2)

    def after(i: int, loss: Tensor) -> None:
        if i >= 2:
            averaged.update_parameters(net)
            swalr.step()

    stab = simple(ctx, net, opt, after_step=after, schedulers=[swalr])
    update_bn([x for x, _ in ctx.batches()], averaged)
    ctx.final += [t.detach().clone() for t in averaged.state_dict().values()]
    return stab


def keep_zeros(ctx: Ctx) -> Any:
    """``zero_grad(set_to_none=False)``: the gradients stay the same tensors all run."""
    net = Net()
    ctx.nan(net.a)
    opt = adamw(net)
    return simple(ctx, net, opt, zero=lambda: opt.zero_grad(set_to_none=False))


def scaler_clip(ctx: Ctx) -> Any:
    """fp16 autocast and a CPU ``GradScaler``; the loop unscales and clips itself (torch's AMP
    recipe), without telling the Stabilizer (no ``before_step``)."""
    net = Net()
    ctx.nan(net.a)
    opt = adamw(net)
    scaler = torch.amp.GradScaler("cpu")

    def body(loop: Loop, x: Tensor, y: Tensor) -> None:
        with torch.autocast("cpu", torch.float16):
            loss = mse(net(x), y)
        if loop.stab is not None:
            loop.stab.backward(loss)
        else:
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return frame(ctx, net, opt, body, scaler=scaler)


def disabled_scaler(ctx: Ctx) -> Any:
    """nanoGPT's ``GradScaler(enabled=dtype == "float16")`` under a bf16 autocast: a disabled
    scaler, its ``scale``/``step``/``update`` called all the same."""
    net = Net()
    ctx.nan(net.a)
    opt = adamw(net)
    scaler = torch.amp.GradScaler("cpu", enabled=False)

    def body(loop: Loop, x: Tensor, y: Tensor) -> None:
        with torch.autocast("cpu", torch.bfloat16):
            loss = mse(net(x), y)
        if loop.stab is not None:
            loop.stab.backward(loss)
        else:
            scaler.scale(loss).backward()
            nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return frame(ctx, net, opt, body, scaler=scaler, precision="bf16-mixed", clip=1.0)


def shared_parameter(ctx: Ctx) -> Any:
    """Two optimizers, one parameter (the norm's weight) in both."""
    net = Net()
    ctx.nan(net.a)
    first = torch.optim.AdamW([*net.a.parameters(), net.norm.weight], lr=1e-2)
    second = torch.optim.SGD([net.norm.weight, *net.b.parameters()], lr=1e-2)

    def body(loop: Loop, x: Tensor, y: Tensor) -> None:
        loop.backward(mse(net(x), y))
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()

    return frame(ctx, net, [first, second], body)


def subset(ctx: Ctx) -> Any:
    """An optimizer over the head only; the rest still gets gradients, that nothing applies."""
    net = Net()
    ctx.nan(net.a)
    opt = torch.optim.AdamW(net.b.parameters(), lr=1e-2)
    return simple(ctx, net, opt, zero=lambda: net.zero_grad())


def freeze_midway(ctx: Ctx) -> Any:
    """The first layer frozen at step 2 (``requires_grad_(False)``)."""
    net = Net()
    ctx.nan(net.norm)
    opt = adamw(net)
    return simple(ctx, net, opt, after_step=lambda i, loss: i == 1 and net.a.requires_grad_(False))


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


LOOP = {
    "compile-eager": compiled("eager"),
    "compile-aot_eager": compiled("aot_eager"),
    "checkpoint-nonreentrant": checkpointed(False),
    "checkpoint-reentrant": checkpointed(True),
    "onecycle-per-step": onecycle,
    "reduce-on-plateau": plateau,
    "ema-averaged-model": ema,
    "swa-swalr-update_bn": swa,
    "zero_grad-set_to_none-False": keep_zeros,
    "gradscaler-unscale-clip": scaler_clip,
    "disabled-scaler-bf16-autocast": disabled_scaler,
    "shared-parameter-two-optimizers": shared_parameter,
    "optimizer-over-a-subset": subset,
    "requires_grad-off-midway": freeze_midway,
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
SLOW = {"compile-inductor": compiled("inductor")}
del NAN_AT
