"""Round 6's setups in a plain loop (`Stabilizer`), as users write them; the loop's frame."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from setups_harness import Ctx, Net, mse
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
    return frame(ctx, net, opt, scaled(net, opt, scaler, clip=0.5), scaler=scaler)


def scaled(net: nn.Module, opt: Any, scaler: Any, clip: float | None) -> Body:
    """torch's AMP recipe under an fp16 autocast: scale, backward, (unscale and clip,) step,
    update."""

    def body(loop: Loop, x: Tensor, y: Tensor) -> None:
        with torch.autocast("cpu", torch.float16):
            loss = mse(net(x), y)
        if loop.stab is not None:
            loop.stab.backward(loss)
        else:
            scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(net.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return body


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


LOOP = {
    "compile-eager": compiled("eager"),
    "compile-aot_eager": compiled("aot_eager"),
    "compile-inductor": compiled("inductor"),
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
}
