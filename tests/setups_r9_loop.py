"""Round 9's setups in a plain loop (`Stabilizer`), as users write them.

Optimizers at the settings users change (``maximize``, ``foreach=False``, ``fused`` on the CPU,
``capturable``, a tensor LR, ...), LR schedules that cycle, and models whose shapes round 6 did
not try: torch's own Transformer layers, `scaled_dot_product_attention`, a top-k MoE with an
auxiliary loss, recurrent LMs, a CLIP-style learnable temperature, a VAE, a diffusion loss, the
old hook-based `spectral_norm`, a LoRA fine-tune with `peft`, a PPO-style pair of optimizers.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from setups_harness import BATCH, STEPS, Ctx, Net, mse
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


# --- models ---------------------------------------------------------------------------------

VOCAB, SEQ = 16, 6


def tokens(ctx: Ctx, vocab: int = VOCAB, seq: int = SEQ) -> list[Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (BATCH, seq), generator=g) for _ in range(STEPS)]


def lm_loop(ctx: Ctx, model: nn.Module, nan: nn.Module, lm: Any, **kwargs: Any) -> Any:
    """A token LM's loop: `lm(model, ids)` is the loss; AdamW, clip=1 by the Stabilizer."""
    ctx.nan(nan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loop = Loop(ctx, model, opt, **kwargs)
    for i, ids in enumerate(tokens(ctx)):
        ctx.begin(i, [model], [opt])
        with loop.step():
            loop.backward(lm(model, ids))
            if loop.stab is None and "clip" in kwargs:  # (the Stabilizer clips: `clip=`)
                nn.utils.clip_grad_norm_(model.parameters(), kwargs["clip"])
            opt.step()
            opt.zero_grad(set_to_none=True)
    ctx.finish([model], [opt])
    return loop.close()


def next_token(model: nn.Module, ids: Tensor) -> Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


class TorchEncoderLM(nn.Module):
    """A GPT of torch's own ``nn.TransformerEncoderLayer`` (post-LN, the default), a causal
    mask passed at each call."""

    def __init__(self, norm_first: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True,
                                           norm_first=norm_first)  # fmt: skip
        self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        out: Tensor = self.head(self.body(self.embed(ids), mask=mask, is_causal=True))
        return out


def torch_encoder(ctx: Ctx) -> Any:
    model = TorchEncoderLM()
    return lm_loop(ctx, model, model.body.layers[1].linear2, next_token)


class SdpaLM(nn.Module):
    """Attention written with ``F.scaled_dot_product_attention(is_causal=True)``, pre-LN."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.norm = nn.LayerNorm(16)
        self.qkv = nn.Linear(16, 48)
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids)
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, 16))
        out: Tensor = self.head(x)
        return out


def sdpa(ctx: Ctx) -> Any:
    model = SdpaLM()
    return lm_loop(ctx, model, model.qkv, next_token)


class MoE(nn.Module):
    """Top-2 routing over 4 expert MLPs, with a Switch-style load-balancing auxiliary loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.router = nn.Linear(16, 4)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(4)
        )
        self.head = nn.Linear(16, VOCAB)
        self.aux = torch.zeros(())

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids)
        probs = self.router(x).softmax(-1)
        weight, chosen = probs.topk(2, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            hit = (chosen == e).any(-1)
            if hit.any():
                w = (weight * (chosen == e)).sum(-1, keepdim=True)[hit]
                out[hit] = out[hit] + w * expert(x[hit])
        load = F.one_hot(chosen[..., 0], 4).float().mean((0, 1))
        self.aux = 4 * (load * probs.mean((0, 1))).sum()
        logits: Tensor = self.head(x + out)
        return logits


def moe(ctx: Ctx) -> Any:
    model = MoE()

    def lm(m: nn.Module, ids: Tensor) -> Tensor:
        return next_token(m, ids) + 0.01 * model.aux

    return lm_loop(ctx, model, model.experts[0], lm)


class RecurrentLM(nn.Module):
    def __init__(self, cell: type[nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.rnn = cell(16, 16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        out: Tensor = self.head(self.rnn(self.embed(ids))[0])
        return out


def recurrent(cell: type[nn.Module]) -> Any:
    def run(ctx: Ctx) -> Any:
        model = RecurrentLM(cell)
        return lm_loop(ctx, model, model.embed, next_token, clip=0.25)

    return run


class Clip(nn.Module):
    """Two towers and CLIP's learnable temperature (``logit_scale``, clamped at 100)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.image = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 8))
        self.text = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 8))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        a, b = F.normalize(self.image(x), dim=-1), F.normalize(self.text(y), dim=-1)
        logits = self.logit_scale.exp().clamp(max=100) * a @ b.T
        labels = torch.arange(len(x))
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def clip(ctx: Ctx) -> Any:
    model = Clip()
    ctx.nan(model.image)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.2)

    def body(loop: Loop, x: Tensor, y: Tensor) -> None:
        loop.backward(model(x, x.flip(-1) + 0.1 * y))
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))

    return frame(ctx, model, opt, body)


class Vae(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(4, 8)
        self.dec = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 4))
        self.noise = torch.Generator().manual_seed(1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.enc(x)
        mu, logvar = h[:, :2], h[:, 2:4]
        eps = torch.randn(mu.shape, generator=self.noise)
        z = mu + (0.5 * logvar).exp() * eps
        kl = -0.5 * (1 + logvar - mu**2 - logvar.exp()).sum(-1).mean()
        return F.mse_loss(self.dec(z), x) + 0.1 * kl


def vae(ctx: Ctx) -> Any:
    model = Vae()
    ctx.nan(model.enc)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def body(loop: Loop, x: Tensor, y: Tensor) -> None:
        loop.backward(model(x))
        opt.step()
        opt.zero_grad()

    return frame(ctx, model, opt, body)


class Denoiser(nn.Module):
    """A DDPM-style loss: predict the noise added at a random timestep (a time embedding)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.time = nn.Embedding(10, 8)
        self.a = nn.Linear(4, 8)
        self.b = nn.Sequential(nn.SiLU(), nn.Linear(8, 4))
        self.bars = torch.linspace(0.99, 0.1, 10)

    def forward(self, x: Tensor, t: Tensor, noise: Tensor) -> Tensor:
        bar = self.bars[t].unsqueeze(-1)
        noisy = bar.sqrt() * x + (1 - bar).sqrt() * noise
        return F.mse_loss(self.b(self.a(noisy) + self.time(t)), noise)


def diffusion(ctx: Ctx) -> Any:
    model = Denoiser()
    ctx.nan(model.a)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(2)

    def body(loop: Loop, x: Tensor, y: Tensor) -> None:
        t = torch.randint(0, 10, (len(x),), generator=g)
        loop.backward(model(x, t, torch.randn(x.shape, generator=g)))
        opt.step()
        opt.zero_grad()

    return frame(ctx, model, opt, body)


def spectral_norm_hooks(ctx: Ctx) -> Any:
    """The old hook-based ``nn.utils.spectral_norm``: its power iteration writes the buffers
    ``weight_u``/``weight_v`` in each training forward."""
    net = Net()
    net.a = nn.utils.spectral_norm(net.a)
    ctx.nan(net.norm)
    return simple(ctx, net, torch.optim.AdamW(net.parameters(), lr=1e-2))


def weight_norm_hooks(ctx: Ctx) -> Any:
    """The old hook-based ``nn.utils.weight_norm`` (``weight_g``, ``weight_v``)."""
    net = Net()
    net.a = nn.utils.weight_norm(net.a)
    ctx.nan(net.norm)
    return simple(ctx, net, torch.optim.AdamW(net.parameters(), lr=1e-2))


def lora(ctx: Ctx) -> Any:
    """A LoRA fine-tune with ``peft`` of a tiny Llama: the base frozen, only the adapters in
    the optimizer."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=16)  # fmt: skip
    model = get_peft_model(
        LlamaForCausalLM(config), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    adapters = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(adapters, lr=1e-2)
    layer = model.base_model.model.model.layers[0].mlp
    ctx.nan(layer)
    loop = Loop(ctx, model, opt)
    for i, ids in enumerate(tokens(ctx)):
        ctx.begin(i, [model], [opt])
        with loop.step():
            loop.backward(model(input_ids=ids, labels=ids).loss)
            opt.step()
            opt.zero_grad()
    ctx.finish([model], [opt])
    return loop.close()


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
    "torch-encoder-post-ln": torch_encoder,
    "sdpa-causal": sdpa,
    "moe-top2-aux-loss": moe,
    "lstm-lm-clip": recurrent(nn.LSTM),
    "gru-lm-clip": recurrent(nn.GRU),
    "clip-logit-scale": clip,
    "vae-kl": vae,
    "diffusion-noise-mse": diffusion,
    "spectral-norm-hooks": spectral_norm_hooks,
    "weight-norm-hooks": weight_norm_hooks,
    "peft-lora-llama-loop": lora,
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


def orthogonal(ctx: Ctx) -> Any:
    """``parametrizations.orthogonal`` on the first layer (its ``original`` is what trains)."""
    net = Net()
    nn.utils.parametrizations.orthogonal(net.a)
    ctx.nan(net.norm)
    return simple(ctx, net, torch.optim.AdamW(net.parameters(), lr=1e-2))


def fused_tensor_lr(ctx: Ctx) -> Any:
    """``Adam(fused=True)`` with a tensor LR, as used for ``torch.compile``d optimizers."""
    return _opt("Adam", lr=torch.tensor(1e-2), fused=True)(ctx)


LOOP9.update({
    "sam-two-step": sam,
    "orthogonal-parametrization": orthogonal,
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
