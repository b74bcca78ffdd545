"""Round 9's setups under the Hugging Face ``Trainer``, each as a user writes it: the model
families a Transformer team fine-tunes (Llama, Mistral, Qwen2, T5 under `Seq2SeqTrainer`, BERT's
masked LM with its collator, a ViT), a LoRA adapter with ``peft``, a `Trainer` subclass with its
own `compute_loss` or `training_step`, and the arguments users set."""

from __future__ import annotations

from typing import Any

import torch
from setups_harness import BATCH, STEPS, Ctx
from setups_hf import hf
from torch import Tensor, nn

VOCAB = 32


def ids(rows: int = STEPS * BATCH, seq: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(4, VOCAB, (rows, seq), generator=g)


def lm_data(accumulate: int = 1) -> list[dict[str, Tensor]]:
    return [{"input_ids": row, "labels": row} for row in ids(STEPS * BATCH * accumulate)]


def decoder(kind: str) -> nn.Module:
    """A tiny decoder-only model of family `kind`, random weights."""
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{kind}Config")(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
    )  # fmt: skip
    model: nn.Module = getattr(transformers, f"{kind}ForCausalLM")(config)
    return model


def causal(kind: str, **kwargs: Any) -> Any:
    def run(ctx: Ctx) -> Any:
        model = decoder(kind)
        ctx.nan(model.model.layers[0].mlp)
        return hf(ctx, model=model, data=lm_data(), **kwargs)

    return run


def llama_accumulate_tokens(ctx: Ctx) -> Any:
    """Accumulation over 2 micro-batches with the loss averaged over the step's tokens
    (``average_tokens_across_devices``, HF's token-count normalization); a NaN in the second."""
    model = decoder("Llama")
    ctx.nan(model.model.layers[1].self_attn.o_proj)
    return hf(ctx, accumulate=2, model=model, data=lm_data(2),
              average_tokens_across_devices=True, max_grad_norm=1.0)  # fmt: skip


def lora(ctx: Ctx) -> Any:
    """``peft`` LoRA on a tiny Llama: the base frozen, the adapters trained by the Trainer."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(decoder("Llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    ctx.nan(model.base_model.model.model.layers[0].mlp)
    return hf(ctx, model=model, data=lm_data())


def bert_mlm(ctx: Ctx) -> Any:
    """BERT's masked LM with ``DataCollatorForLanguageModeling`` (random masks per batch)."""
    from transformers import BertConfig, BertForMaskedLM, DataCollatorForLanguageModeling

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    model = BertForMaskedLM(config)
    ctx.nan(model.bert.encoder.layer[0].intermediate)

    class Tok:  # (what the collator asks of a tokenizer)
        mask_token, mask_token_id, pad_token_id, padding_side = "[MASK]", 3, 0, "right"

        def __len__(self) -> int:
            return VOCAB

        def convert_tokens_to_ids(self, token: str) -> int:
            return self.mask_token_id

        def get_special_tokens_mask(self, row: Any, **kw: Any) -> list[int]:
            return [0] * len(row)

        def pad(self, rows: Any, return_tensors: str = "pt", **kw: Any) -> Any:
            return {"input_ids": torch.stack([torch.as_tensor(r["input_ids"]) for r in rows])}

    collator = DataCollatorForLanguageModeling(Tok(), mlm_probability=0.3)  # type: ignore[arg-type]
    data = [{"input_ids": row} for row in ids()]
    return hf(ctx, model=model, data=data, trainer_kwargs={"data_collator": collator})


def vit(ctx: Ctx) -> Any:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16,
                       num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                       num_labels=3)  # fmt: skip
    model = ViTForImageClassification(config)
    ctx.nan(model.vit.layers[1].mlp)
    g = torch.Generator().manual_seed(0)
    data = [
        {"pixel_values": torch.randn(3, 8, 8, generator=g),
         "labels": torch.randint(0, 3, (), generator=g)}
        for _ in range(STEPS * BATCH)
    ]  # fmt: skip
    return hf(ctx, model=model, data=data)


def t5_seq2seq(ctx: Ctx) -> Any:
    """T5 under ``Seq2SeqTrainer`` with ``Seq2SeqTrainingArguments``."""
    from transformers import (
        Seq2SeqTrainer,
        Seq2SeqTrainingArguments,
        T5Config,
        T5ForConditionalGeneration,
        TrainerCallback,
    )

    from stabilizer.hosts.hf import StabilityCallback

    torch.manual_seed(0)
    config = T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                      decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    model = T5ForConditionalGeneration(config)
    ctx.nan(model.encoder.block[0].layer[1])
    rows = ids()
    data = [{"input_ids": r, "labels": r.flip(0)} for r in rows]

    class Capture(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            ctx.begin(state.global_step, [kw["model"]], [kw["optimizer"]])

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            ctx.finish([kw["model"]], [kw["optimizer"]])

    args = Seq2SeqTrainingArguments(
        output_dir=str(ctx.tmp / "hf"), max_steps=STEPS, per_device_train_batch_size=BATCH,
        learning_rate=1e-3, report_to="none", save_strategy="no", use_cpu=True,
        disable_tqdm=True, logging_steps=1000, predict_with_generate=True,
    )  # fmt: skip
    callback = StabilityCallback(jsonl=ctx.jsonl) if ctx.monitored else None
    trainer = Seq2SeqTrainer(
        model=model,
        args=args,
        train_dataset=data,
        callbacks=[Capture(), *([callback] if callback else [])],
    )
    trainer._get_train_sampler = lambda *a: torch.utils.data.SequentialSampler(data)  # type: ignore[method-assign]
    trainer.train()
    return callback


class _Net(nn.Module):
    """The harness's net, called with keyword inputs; returns the output (no loss)."""

    def __init__(self) -> None:
        super().__init__()
        from setups_harness import Net

        self.net = Net()

    def forward(self, x: Tensor, labels: Tensor | None = None) -> Tensor:
        out: Tensor = self.net(x)
        return out


def own_compute_loss(ctx: Ctx) -> Any:
    """A ``Trainer`` subclass overriding ``compute_loss`` (a Huber loss from the outputs)."""
    from transformers import Trainer

    model = _Net()
    ctx.nan(model.net.a)

    class Huber(Trainer):
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:  # fmt: skip
            labels = inputs.pop("labels")
            out = model(**inputs)
            loss = nn.functional.huber_loss(out, labels)
            return (loss, out) if return_outputs else loss

    return hf(ctx, model=model, trainer_class=Huber)


def own_training_step(ctx: Ctx) -> Any:
    """A ``Trainer`` subclass overriding ``training_step``: its own forward, loss and
    ``self.accelerator.backward`` (the pattern of TRL's trainers)."""
    from transformers import Trainer

    model = _Net()
    ctx.nan(model.net.a)

    class Own(Trainer):
        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Tensor:
            model.train()
            out = model(inputs["x"])
            loss = ((out - inputs["labels"]) ** 2).mean()
            self.accelerator.backward(loss)
            return loss.detach()

    return hf(ctx, model=model, trainer_class=Own)


def evaluated(ctx: Ctx) -> Any:
    """``eval_strategy="steps"`` every 2 steps (the model's forward outside any step)."""
    model = decoder("Llama")
    ctx.nan(model.model.layers[0].mlp)
    return hf(ctx, model=model, data=lm_data(), trainer_kwargs={"eval_dataset": lm_data()[:8]},
              eval_strategy="steps", eval_steps=2)  # fmt: skip


HF9 = {
    "hf-llama": causal("Llama"),
    "hf-mistral": causal("Mistral"),
    "hf-qwen2-cosine-warmup": causal("Qwen2", lr_scheduler_type="cosine", warmup_steps=2),
    "hf-llama-accumulate-average-tokens": llama_accumulate_tokens,
    "hf-peft-lora-llama": lora,
    "hf-bert-mlm-collator": bert_mlm,
    "hf-vit-classification": vit,
    "hf-t5-seq2seq-trainer": t5_seq2seq,
    "hf-own-compute_loss": own_compute_loss,
    "hf-own-training_step": own_training_step,
    "hf-max_grad_norm-0": causal("Llama", max_grad_norm=0.0),
    "hf-eval-strategy-steps": evaluated,
    "hf-num-input-tokens-seen": causal("Llama", include_num_input_tokens_seen=True),
}


def best_at_end(ctx: Ctx) -> Any:
    """``load_best_model_at_end`` with ``EarlyStoppingCallback``: evaluated and saved every 2
    steps; at the end the Trainer loads the best checkpoint's weights into the model."""
    from transformers import EarlyStoppingCallback

    model = decoder("Llama")
    ctx.nan(model.model.layers[0].mlp)
    return hf(
        ctx, model=model, data=lm_data(),
        trainer_kwargs={"eval_dataset": lm_data()[:8],
                        "callbacks": [EarlyStoppingCallback(early_stopping_patience=10)]},
        eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
        load_best_model_at_end=True, metric_for_best_model="loss",
    )  # fmt: skip


def lora_checkpointing(ctx: Ctx) -> Any:
    """``peft`` LoRA with ``gradient_checkpointing=True`` (the frozen embeddings' output made
    to require grad by ``enable_input_require_grads``, as peft's docs say)."""
    from peft import LoraConfig, get_peft_model

    base = decoder("Llama")
    base.enable_input_require_grads()
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    ctx.nan(model.base_model.model.model.layers[0].mlp)
    return hf(ctx, model=model, data=lm_data(), gradient_checkpointing=True,
              gradient_checkpointing_kwargs={"use_reentrant": False})  # fmt: skip


class Stream(torch.utils.data.IterableDataset[dict[str, Tensor]]):
    def __iter__(self) -> Any:
        return iter(lm_data())


def iterable(ctx: Ctx) -> Any:
    """An ``IterableDataset`` (no length) with ``max_steps``."""
    model = decoder("Qwen2")
    ctx.nan(model.model.layers[1].mlp)
    return hf(ctx, model=model, data=Stream())


HF9.update({
    "hf-load-best-model-at-end": best_at_end,
    "hf-peft-lora-gradient-checkpointing": lora_checkpointing,
    "hf-iterable-dataset": iterable,
})  # fmt: skip


def epoch_ends_mid_accumulation(ctx: Ctx) -> Any:
    """``num_train_epochs=1`` over 7 batches with ``gradient_accumulation_steps=2``: the
    epoch's last step has one micro-batch."""
    model = decoder("Llama")
    ctx.nan(model.model.layers[0].mlp)
    data = [{"input_ids": row, "labels": row} for row in ids(7 * BATCH)]
    return hf(ctx, accumulate=2, model=model, data=data, max_steps=-1, num_train_epochs=1)


HF9["hf-epoch-ends-mid-accumulation"] = epoch_ends_mid_accumulation


def resumed(ctx: Ctx) -> Any:
    """Trained to step 2 with a checkpoint, then a new ``Trainer`` resumes it
    (``resume_from_checkpoint=True``: the last one in ``output_dir``) and trains to step 6;
    the NaN at step 3, after the resume."""
    model = decoder("Llama")
    ctx.nan(model.model.layers[0].mlp)
    first = hf(ctx, model=model, data=lm_data(), max_steps=2, save_strategy="steps", save_steps=2)
    del first
    model = decoder("Llama")
    ctx.nan(model.model.layers[0].mlp)
    return hf(ctx, model=model, data=lm_data(), save_strategy="steps", save_steps=2,
              resume=True)  # fmt: skip


HF9["hf-resume-from-checkpoint-true"] = resumed


def fp16(ctx: Ctx) -> Any:
    """``fp16=True`` on the CPU (accelerate's fp16 autocast and its grad scaler)."""
    model = decoder("Llama")
    ctx.nan(model.model.layers[0].mlp)
    return hf(ctx, model=model, data=lm_data(), fp16=True, max_grad_norm=1.0)


HF9["hf-fp16-cpu"] = fp16
