"""Round 9's model setups in a plain loop (`Stabilizer`), as users write them: torch's own
Transformer layers, `scaled_dot_product_attention`, a top-k MoE with an auxiliary loss,
recurrent LMs, a CLIP-style learnable temperature, a VAE, a diffusion loss, the old hook-based
`spectral_norm`/`weight_norm` and the `orthogonal` parametrization, a LoRA fine-tune with
`peft`."""

from __future__ import annotations

import math
from typing import Any

import torch
from setups_harness import BATCH, STEPS, Ctx, Net
from setups_loop import Loop, frame, simple
from torch import Tensor, nn
from torch.nn import functional as F

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


def orthogonal(ctx: Ctx) -> Any:
    """``parametrizations.orthogonal`` on the first layer (its ``original`` is what trains)."""
    net = Net()
    nn.utils.parametrizations.orthogonal(net.a)
    ctx.nan(net.norm)
    return simple(ctx, net, torch.optim.AdamW(net.parameters(), lr=1e-2))


MODELS9 = {
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
    "orthogonal-parametrization": orthogonal,
}
