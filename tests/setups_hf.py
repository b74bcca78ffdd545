"""Round 6's setups under the Hugging Face ``Trainer``, each as a user writes it."""

from __future__ import annotations

from typing import Any

import torch
from setups_harness import BATCH, STEPS, Ctx, Net, mse
from torch import Tensor, nn


class Model(nn.Module):
    """The net as the ``Trainer`` calls one: keyword inputs, a dict with the loss."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Tensor, labels: Tensor) -> dict[str, Tensor]:
        return {"loss": mse(self.net(x), labels)}


class Examples(torch.utils.data.Dataset[dict[str, Tensor]]):
    def __init__(self, batches: list[tuple[Tensor, Tensor]]) -> None:
        self.rows = [(a, b) for x, y in batches for a, b in zip(x, y, strict=True)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"x": self.rows[i][0], "labels": self.rows[i][1]}


def hf(
    ctx: Ctx,
    accumulate: int = 1,
    model: Any = None,
    data: Any = None,
    trainer_class: Any = None,
    trainer_kwargs: Any = None,
    resume: bool = False,
    **kwargs: Any,
) -> Any:
    """`trainer_class` (a ``Trainer`` subclass) built with `trainer_kwargs` besides, and the
    ``TrainingArguments`` given in `kwargs`; `resume`: ``train(resume_from_checkpoint=True)``."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from stabilizer.hosts.hf import StabilityCallback

    class Capture(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            ctx.begin(state.global_step, [kw["model"]], [kw["optimizer"]])

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            ctx.finish([kw["model"]], [kw["optimizer"]])

    if model is None:
        net = Net()
        ctx.nan(net.a)
        model = Model(net)
    args = TrainingArguments(**{
        "output_dir": str(ctx.tmp / "hf"), "max_steps": STEPS,
        "per_device_train_batch_size": BATCH, "gradient_accumulation_steps": accumulate,
        "learning_rate": 1e-2, "report_to": "none", "save_strategy": "no", "use_cpu": True,
        "disable_tqdm": True, "logging_steps": 1000, **kwargs,
    })  # fmt: skip
    callback = StabilityCallback(jsonl=ctx.jsonl) if ctx.monitored else None
    given = dict(trainer_kwargs or {})
    trainer = (trainer_class or Trainer)(
        model=model, args=args, **{k: v for k, v in given.items() if k != "callbacks"},
        train_dataset=data if data is not None else Examples(ctx.batches(accumulate=accumulate)),
        callbacks=[Capture(), *([callback] if callback else []), *given.get("callbacks", [])],
    )  # fmt: skip
    trainer._get_train_sampler = lambda *a: torch.utils.data.SequentialSampler(
        trainer.train_dataset
    )  # type: ignore[method-assign]
    trainer.train(resume_from_checkpoint=resume or None)
    return callback


def accumulate_clip(ctx: Ctx) -> Any:
    return hf(ctx, accumulate=2, max_grad_norm=1.0)


def cosine_warmup(ctx: Ctx) -> Any:
    return hf(ctx, lr_scheduler_type="cosine", warmup_steps=2)


def fused(ctx: Ctx) -> Any:
    return hf(ctx, optim="adamw_torch_fused")


def adafactor(ctx: Ctx) -> Any:
    return hf(ctx, optim="adafactor")


def bf16(ctx: Ctx) -> Any:
    return hf(ctx, bf16=True)


def gpt2(ctx: Ctx, **kwargs: Any) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=64, n_positions=16)
    model = GPT2LMHeadModel(config)
    ctx.nan(model.transformer.h[0].mlp)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (STEPS * BATCH, 8), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]
    return hf(ctx, model=model, data=data, **kwargs)


def gpt2_checkpointing(ctx: Ctx) -> Any:
    return gpt2(ctx, gradient_checkpointing=True)


def gpt2_label_smoothing(ctx: Ctx) -> Any:
    return gpt2(ctx, label_smoothing_factor=0.1)


def compiled(ctx: Ctx) -> Any:
    torch._dynamo.reset()
    return hf(ctx, torch_compile=True, torch_compile_backend="eager")


def gpt2_neftune(ctx: Ctx) -> Any:
    """NEFTune: noise added to the embeddings' output by a forward hook of the Trainer's."""
    return gpt2(ctx, neftune_noise_alpha=5.0)


HF = {
    "hf-accumulate-max_grad_norm": accumulate_clip,
    "hf-cosine-warmup": cosine_warmup,
    "hf-adamw_torch_fused": fused,
    "hf-optim-adafactor": adafactor,
    "hf-bf16-cpu": bf16,
    "hf-gpt2-gradient-checkpointing": gpt2_checkpointing,
    "hf-gpt2-label-smoothing": gpt2_label_smoothing,
    "hf-torch-compile": compiled,
    "hf-gpt2-neftune": gpt2_neftune,
}
