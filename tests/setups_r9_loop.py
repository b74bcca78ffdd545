"""Round 9's setups in a plain loop (`Stabilizer`), as users write them: optimizers at the
settings users change (``maximize``, ``foreach=False``, ``fused`` on the CPU, a tensor LR, ...),
wrapper optimizers (SAM, a Lookahead), LR schedules that cycle, loops with two optimizers (PPO,
a GAN under Fabric), a grad scaler's own skips, an inner loop, a compiled optimizer step, a new
optimizer mid-run. The models' setups are in `setups_r9_models`."""

from __future__ import annotations

from typing import Any

import torch
from setups_harness import STEPS, Ctx, Net, mse
from setups_loop import Loop, frame, scaled, simple
from torch import Tensor, nn
from torch.nn import functional as F


def optimizer(make: Any) -> Any:
    """The net under the optimizer `make(params)` builds, the NaN in its first layer."""

    def run(ctx: Ctx) -> Any:
        net = Net()
        ctx.nan(net.a)
        return simple(ctx, net, make(net.parameters()))

    return run


def lbfgs_wolfe(ctx: Ctx) -> Any:
    """LBFGS with a strong-Wolfe line search, its closure evaluated several times a step."""
    net = Net()
    ctx.nan(net.a)
    opt = torch.optim.LBFGS(net.parameters(), lr=0.5, max_iter=4, line_search_fn="strong_wolfe")

    def body(loop: Loop, x: Tensor, y: Tensor) -> None:
        def closure() -> Tensor:
            opt.zero_grad()
            loss = mse(net(x), y)
            loop.backward(loss)
            return loss

        opt.step(closure)

    return frame(ctx, net, opt, body)


def scheduled(make: Any, sgd: bool = False) -> Any:
    """The net with AdamW (or SGD with momentum) and the scheduler `make(opt)` stepped after
    each optimizer step, told to the Stabilizer."""

    def run(ctx: Ctx) -> Any:
        net = Net()
        ctx.nan(net.a)
        params = net.parameters()
        opt: torch.optim.Optimizer = (
            torch.optim.SGD(params, lr=1e-2, momentum=0.9) if sgd
            else torch.optim.AdamW(params, lr=1e-2)
        )  # fmt: skip
        sched = make(opt)
        return simple(ctx, net, opt, after_step=lambda i, loss: sched.step(), schedulers=[sched])

    return run


def sequential(opt: torch.optim.Optimizer) -> Any:
    lr = torch.optim.lr_scheduler
    warm = lr.LinearLR(opt, start_factor=0.1, total_iters=2)
    cos = lr.CosineAnnealingLR(opt, T_max=STEPS)
    return lr.SequentialLR(opt, [warm, cos], milestones=[2])


def ppo(ctx: Ctx) -> Any:
    """PPO-style: an actor and a critic, each its own optimizer; the critic steps every batch,
    the actor only every second one (after its own backward)."""
    actor, critic = Net(), Net(width=6)
    ctx.nan(actor.a)
    model = nn.ModuleDict({"actor": actor, "critic": critic})
    a_opt = torch.optim.Adam(actor.parameters(), lr=1e-3)
    c_opt = torch.optim.Adam(critic.parameters(), lr=1e-3)
    loop = Loop(ctx, model, [a_opt, c_opt])
    for i, (x, y) in enumerate(ctx.batches()):
        ctx.begin(i, [actor], [a_opt])  # (the critic's healthy step at the NaN step runs)
        with loop.step():
            value_loss = mse(critic(x), y)
            loop.backward(value_loss)
            c_opt.step()
            c_opt.zero_grad()
            if i % 2 == 1:
                advantage = (y - critic(x)).detach()
                policy_loss = -(actor(x) * advantage).mean()
                loop.backward(policy_loss)
                a_opt.step()
                a_opt.zero_grad()
    ctx.finish([actor], [a_opt])
    return loop.close()


def gradscaler_skips(ctx: Ctx) -> Any:
    """A CPU ``GradScaler`` with a huge initial scale (its first steps overflow in fp16 and
    are skipped by the scaler), the plain ``scaler.step`` recipe, no clipping."""
    net = Net()
    ctx.nan(net.a)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    return frame(ctx, net, opt, scaled(net, opt, scaler, clip=None), scaler=scaler)


def fabric_gan(ctx: Ctx) -> Any:
    """A GAN under Fabric: two models, two optimizers, each ``fabric.setup`` on its own."""
    from lightning.fabric import Fabric

    from stabilizer.hosts.loop import Stabilizer

    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    gen = Net()
    torch.manual_seed(1)
    disc = nn.Sequential(nn.Linear(1, 6), nn.Tanh(), nn.Linear(6, 1))
    ctx.nan(gen.a)
    gen_m, g_opt = fabric.setup(gen, torch.optim.Adam(gen.parameters(), lr=1e-3))
    disc_m, d_opt = fabric.setup(disc, torch.optim.Adam(disc.parameters(), lr=1e-3))
    both = nn.ModuleDict({"gen": gen, "disc": disc})
    stab = (
        Stabilizer(both, [g_opt, d_opt], fabric=fabric, jsonl=ctx.jsonl) if ctx.monitored
        else None
    )  # fmt: skip
    backward = stab.backward if stab is not None else fabric.backward
    for i, (x, real) in enumerate(ctx.batches()):
        ctx.begin(i, [both], [g_opt, d_opt])
        with stab.step() if stab is not None else _null():
            d_opt.zero_grad()  # (DCGAN's order: each network's gradients zeroed first)
            fake = gen_m(x)
            d_loss = F.softplus(disc_m(fake.detach())).mean() + F.softplus(-disc_m(real)).mean()
            backward(d_loss)
            d_opt.step()
            g_opt.zero_grad()
            g_loss = F.softplus(-disc_m(fake)).mean()
            backward(g_loss)
            g_opt.step()
    ctx.finish([both], [g_opt, d_opt])
    if stab is not None:
        stab.close()
    return stab


def _null() -> Any:
    import contextlib

    return contextlib.nullcontext()


def _opt(name: str, **kwargs: Any) -> Any:
    return optimizer(lambda params: getattr(torch.optim, name)(params, **kwargs))


LOOP9 = {
    "adam-maximize": _opt("Adam", lr=1e-2, maximize=True),
    "adamw-foreach-False": _opt("AdamW", lr=1e-2, foreach=False),
    "adam-fused-cpu": _opt("Adam", lr=1e-2, fused=True),
    "adamw-tensor-lr": _opt("AdamW", lr=torch.tensor(1e-2)),
    "adam-amsgrad-maximize": _opt("Adam", lr=1e-2, amsgrad=True, maximize=True),
    "sgd-nesterov-nan": _opt("SGD", lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "adagrad-nan": _opt("Adagrad", lr=1e-2),
    "rmsprop-centered-momentum": _opt("RMSprop", lr=1e-3, centered=True, momentum=0.9),
    "nadam-decoupled": _opt("NAdam", lr=1e-2, decoupled_weight_decay=True, weight_decay=0.01),
    "radam-decoupled": _opt("RAdam", lr=1e-2, decoupled_weight_decay=True, weight_decay=0.01),
    "adamax-nan": _opt("Adamax", lr=1e-2),
    "asgd-nan": _opt("ASGD", lr=1e-2, t0=2),
    "rprop-nan": _opt("Rprop", lr=1e-2),
    "lbfgs-strong-wolfe": lbfgs_wolfe,
    "sequential-lr": scheduled(sequential),
    "cosine-warm-restarts": scheduled(
        lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=2)
    ),
    "cyclic-lr-momentum": scheduled(
        lambda o: torch.optim.lr_scheduler.CyclicLR(o, 1e-3, 1e-2, step_size_up=2), sgd=True
    ),
    "ppo-two-optimizers": ppo,
    "gradscaler-own-skips": gradscaler_skips,
    "fabric-gan-two-models": fabric_gan,
}


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimization as its popular implementation writes it (davda54/sam):
    ``first_step`` climbs to the worst point nearby, ``second_step`` goes back and lets the
    base optimizer step there; neither calls ``SAM.step``."""

    def __init__(self, params: Any, base: type[torch.optim.Optimizer], rho: float = 0.05,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(params, {"rho": rho, **kwargs})
        self.base_optimizer = base(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        norm = torch.norm(
            torch.stack(
                [
                    p.grad.norm()
                    for g in self.param_groups
                    for p in g["params"]
                    if p.grad is not None
                ]
            )
        )
        for group in self.param_groups:
            scale = group["rho"] / (norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                p.add_(p.grad * scale)
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()


def sam(ctx: Ctx) -> Any:
    """SAM's two forward-backward passes a step; the Stabilizer given the SAM optimizer."""
    net = Net()
    ctx.nan(net.a)
    opt = SAM(net.parameters(), torch.optim.SGD, lr=1e-2, momentum=0.9)

    def body(loop: Loop, x: Tensor, y: Tensor) -> None:
        loop.backward(mse(net(x), y))
        opt.first_step(zero_grad=True)
        loop.backward(mse(net(x), y))
        opt.second_step(zero_grad=True)

    return frame(ctx, net, opt, body)


def fused_tensor_lr(ctx: Ctx) -> Any:
    """``Adam(fused=True)`` with a tensor LR, as used for ``torch.compile``d optimizers."""
    return _opt("Adam", lr=torch.tensor(1e-2), fused=True)(ctx)


LOOP9.update({
    "sam-two-step": sam,
    "adam-fused-tensor-lr": fused_tensor_lr,
})  # fmt: skip


class Lookahead(torch.optim.Optimizer):
    """Lookahead as timm writes it: ``step`` steps the base optimizer (whose param groups it
    shares) and every `k` steps pulls the weights towards slow copies it keeps."""

    def __init__(self, base: torch.optim.Optimizer, alpha: float = 0.5, k: int = 2) -> None:
        super().__init__(base.param_groups, {"lookahead_alpha": alpha, "lookahead_k": k})
        self._base_optimizer = base
        self.param_groups = base.param_groups
        self.defaults = base.defaults
        self.state = base.state
        self.alpha, self.k, self.count = alpha, k, 0
        self.slow = [p.detach().clone() for g in base.param_groups for p in g["params"]]

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = self._base_optimizer.step(closure)
        self.count += 1
        if self.count % self.k == 0:
            with torch.no_grad():
                params = [p for g in self.param_groups for p in g["params"]]
                for slow, p in zip(self.slow, params, strict=True):
                    slow.add_(p - slow, alpha=self.alpha)
                    p.copy_(slow)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._base_optimizer.zero_grad(set_to_none)


def lookahead(ctx: Ctx) -> Any:
    net = Net()
    ctx.nan(net.a)
    opt = Lookahead(torch.optim.AdamW(net.parameters(), lr=1e-2))
    stab = simple(ctx, net, opt)
    ctx.final += [t.clone() for t in opt.slow]
    return stab


LOOP9["lookahead-wrapper"] = lookahead


def inner_updates(ctx: Ctx) -> Any:
    """Two updates of one optimizer in one block (each after its own forward and backward: an
    inner loop, as meta-learning's and RL's K epochs over one batch write it)."""
    net = Net()
    ctx.nan(net.a)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)

    def body(loop: Loop, x: Tensor, y: Tensor) -> None:
        for _ in range(2):
            loop.backward(mse(net(x), y))
            opt.step()
            opt.zero_grad()

    return frame(ctx, net, opt, body)


LOOP9["two-updates-a-block"] = inner_updates


def zero_first(ctx: Ctx) -> Any:
    """The tutorials' order: ``zero_grad()`` first, then forward, backward, step."""
    net = Net()
    ctx.nan(net.a)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)

    def body(loop: Loop, x: Tensor, y: Tensor) -> None:
        opt.zero_grad()
        loop.backward(mse(net(x), y))
        opt.step()

    return frame(ctx, net, opt, body)


def plain_backward(ctx: Ctx) -> Any:
    """``loss.backward()`` left as it was (the ``stab.backward`` line not changed): the step
    is measured inside ``optimizer.step``, with no loss."""
    net = Net()
    ctx.nan(net.a)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)

    def body(loop: Loop, x: Tensor, y: Tensor) -> None:
        mse(net(x), y).backward()
        opt.step()
        opt.zero_grad()

    return frame(ctx, net, opt, body)


def frozen_group(ctx: Ctx) -> Any:
    """Param groups with their own LRs, one at ``lr=0`` (frozen by its LR), one with no decay."""
    net = Net()
    ctx.nan(net.norm)
    opt = torch.optim.AdamW(
        [
            {"params": net.a.parameters(), "lr": 0.0},
            {"params": net.norm.parameters(), "weight_decay": 0.0},
            {"params": net.b.parameters(), "lr": 3e-3},
        ],
        lr=1e-2,
    )
    return simple(ctx, net, opt)


LOOP9.update({
    "zero_grad-first": zero_first,
    "loss.backward-not-stab.backward": plain_backward,
    "param-groups-lr-0": frozen_group,
})  # fmt: skip


def compiled_step(ctx: Ctx) -> Any:
    """torch's recipe "compiling the optimizer": ``opt.step()`` inside a ``torch.compile``d
    function (a tensor LR, so that a scheduler does not recompile it)."""
    torch._dynamo.reset()
    net = Net()
    ctx.nan(net.a)
    opt = torch.optim.AdamW(net.parameters(), lr=torch.tensor(1e-2))

    @torch.compile(backend="eager")
    def step() -> None:
        opt.step()

    def body(loop: Loop, x: Tensor, y: Tensor) -> None:
        loop.backward(mse(net(x), y))
        step()
        opt.zero_grad()

    return frame(ctx, net, opt, body)


LOOP9["compiled-optimizer-step"] = compiled_step


def new_optimizer(ctx: Ctx) -> Any:
    """Two-stage fine-tuning: the head alone for two steps, then everything unfrozen and a new
    optimizer made over it (the Stabilizer was given the first one)."""
    net = Net()
    ctx.nan(net.a)
    net.a.requires_grad_(False)
    opts = [torch.optim.AdamW(net.b.parameters(), lr=1e-2)]
    loop = Loop(ctx, net, opts[0])
    for i, (x, y) in enumerate(ctx.batches()):
        if i == 2:
            net.a.requires_grad_(True)
            opts.append(torch.optim.AdamW(net.parameters(), lr=1e-3))
        ctx.begin(i, [net], opts[-1:])
        with loop.step():
            loop.backward(mse(net(x), y))
            opts[-1].step()
            opts[-1].zero_grad()
    ctx.finish([net], opts[-1:])
    return loop.close()


LOOP9["new-optimizer-mid-run"] = new_optimizer
