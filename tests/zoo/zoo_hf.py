"""Hugging Face ``transformers`` families, each built from a tiny config with random weights.

Nothing is downloaded (``HF_HUB_OFFLINE=1``): every model is ``<Family>For...(Config(...))``.
The families cover decoder-only, encoder and encoder-decoder models; dense and mixture-of-experts
blocks (and DeepSeek-V3's latent attention, JetMoE's mixture of attention heads); learned,
sinusoidal, rotary, ALiBi and relative positions; tied and frozen embeddings; and a LoRA
fine-tune (``peft``: frozen base, trainable adapters). Families that build but only repeat one
of these (Granite, OLMo, Phi-MoE, ELECTRA, mBART, Pegasus, ...) are left out for time.

Each keeps its library's defaults (dropout included) except the sizes, and trains with the
Hugging Face Trainer's recipe (weight decay except on biases and norms, a linear LR decay,
gradients clipped to 1.0). The NaN goes into layer 1's feed-forward part.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

from torch import Tensor, nn
from zoo_data import BOS, EOS, PAD, VOCAB, lm_batches, mlm_batches, s2s_batches
from zoo_harness import STEPS, Case

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the hub

__all__ = ["HF_CASES"]

TOKENS = {"pad_token_id": PAD, "bos_token_id": BOS, "eos_token_id": EOS}
SIZES = {"vocab_size": VOCAB, "max_position_embeddings": 64, **TOKENS}
# The Llama-shaped families: hidden 32, 2 layers, 4 query heads on 2 key/value heads.
LLAMA = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, **SIZES,
}  # fmt: skip
BERT = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, **SIZES,
}  # fmt: skip
T5 = {
    "vocab_size": VOCAB, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2,
    "num_decoder_layers": 2, "num_heads": 4, "relative_attention_num_buckets": 8,
    "decoder_start_token_id": PAD, "pad_token_id": PAD, "eos_token_id": EOS,
}  # fmt: skip
BART = {
    "vocab_size": VOCAB, "d_model": 32, "encoder_layers": 2, "decoder_layers": 2,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64, "max_position_embeddings": 64, "decoder_start_token_id": EOS,
    **TOKENS,
}  # fmt: skip
MOE = {"num_experts_per_tok": 2, "output_router_logits": True}  # with the router's aux loss


def _model(model: str, config: str, **kwargs: Any) -> nn.Module:
    import transformers

    built: nn.Module = getattr(transformers, model)(getattr(transformers, config)(**kwargs))
    return built


def _loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    out: Tensor = model(**batch).loss
    return out


def _case(name: str, model: str, config: str, fault: str, kind: str = "lm", **kw: Any) -> Case:
    data = {"lm": lm_batches, "mlm": mlm_batches, "s2s": s2s_batches}[kind]
    return Case(
        name=name, build=partial(_model, model, config, **kw),
        batches=lambda g: data(g, STEPS), loss=_loss, fault=fault, recipe="hf",
    )  # fmt: skip


def _lora() -> nn.Module:
    """Llama with LoRA adapters on the attention projections: the base is frozen."""
    from peft import LoraConfig, get_peft_model

    base = _model("LlamaForCausalLM", "LlamaConfig", **LLAMA)
    adapters = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    peft_model: nn.Module = get_peft_model(base, adapters)
    return peft_model


def _decoders() -> list[Case]:
    mlp1 = "model.layers.1.mlp"
    return [
        _case("gpt2", "GPT2LMHeadModel", "GPT2Config", "transformer.h.1.mlp",
              n_positions=64, n_embd=32, n_layer=2, n_head=4, **SIZES),
        _case("gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig", "gpt_neox.layers.1.mlp", **BERT),
        _case("llama", "LlamaForCausalLM", "LlamaConfig", mlp1, **LLAMA),
        _case("mistral", "MistralForCausalLM", "MistralConfig", mlp1, sliding_window=8, **LLAMA),
        _case("mixtral", "MixtralForCausalLM", "MixtralConfig", "model.layers.1.mlp.experts",
              num_local_experts=4, **MOE, **LLAMA),
        _case("qwen2", "Qwen2ForCausalLM", "Qwen2Config", mlp1, **LLAMA),
        _case("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig", "model.layers.1.mlp.experts",
              num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
              **MOE, **LLAMA),
        _case("qwen3", "Qwen3ForCausalLM", "Qwen3Config", mlp1, head_dim=8, **LLAMA),
        _case("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", "model.layers.1.mlp.experts",
              num_experts=4, moe_intermediate_size=32, head_dim=8, **MOE, **LLAMA),
        _case("phi", "PhiForCausalLM", "PhiConfig", mlp1, partial_rotary_factor=0.5, **BERT),
        _case("phi3", "Phi3ForCausalLM", "Phi3Config", mlp1, **LLAMA),
        _case("gemma", "GemmaForCausalLM", "GemmaConfig", mlp1, head_dim=8, **LLAMA),
        _case("gemma2", "Gemma2ForCausalLM", "Gemma2Config", mlp1, head_dim=8, sliding_window=8,
              **LLAMA),
        _case("falcon_alibi", "FalconForCausalLM", "FalconConfig", "transformer.h.1.mlp",
              alibi=True, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, **SIZES),
        _case("bloom", "BloomForCausalLM", "BloomConfig", "transformer.h.1.mlp",
              hidden_size=32, n_layer=2, n_head=4, **TOKENS, vocab_size=VOCAB),
        _case("opt", "OPTForCausalLM", "OPTConfig", "model.decoder.layers.1.fc2",
              hidden_size=32, ffn_dim=64, word_embed_proj_dim=32, num_hidden_layers=2,
              num_attention_heads=4, **SIZES),
        _case("mpt", "MptForCausalLM", "MptConfig", "transformer.blocks.1.ffn", d_model=32,
              n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=64, vocab_size=VOCAB,
              **TOKENS),
        _case("gpt_bigcode", "GPTBigCodeForCausalLM", "GPTBigCodeConfig", "transformer.h.1.mlp",
              n_positions=64, n_embd=32, n_layer=2, n_head=4, **SIZES),
        _case("starcoder2", "Starcoder2ForCausalLM", "Starcoder2Config", mlp1, sliding_window=8,
              **LLAMA),
        _case("olmo2", "Olmo2ForCausalLM", "Olmo2Config", mlp1, **LLAMA),
        _case("stablelm", "StableLmForCausalLM", "StableLmConfig", mlp1, **LLAMA),
        _case("cohere", "CohereForCausalLM", "CohereConfig", mlp1, **LLAMA),
        _case("olmoe", "OlmoeForCausalLM", "OlmoeConfig", "model.layers.1.mlp.experts",
              num_experts=4, **MOE, **LLAMA),
        _case("gpt_oss", "GptOssForCausalLM", "GptOssConfig", "model.layers.1.mlp.experts",
              num_local_experts=4, head_dim=8, **MOE, **LLAMA),
        _case("deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Config",
              "model.layers.1.mlp.experts", n_routed_experts=4, n_shared_experts=1,
              num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
              kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
              v_head_dim=8, n_group=1, topk_group=1,
              **(LLAMA | {"num_key_value_heads": 4})),  # (latent attention: no grouped KV)
        _case("gptj", "GPTJForCausalLM", "GPTJConfig", "transformer.h.1.mlp", n_positions=64,
              n_embd=32, n_layer=2, n_head=4, rotary_dim=4, **SIZES),
        _case("jetmoe", "JetMoeForCausalLM", "JetMoeConfig", "model.layers.1.mlp",
              num_local_experts=4, num_experts_per_tok=2, kv_channels=8, hidden_size=32,
              intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, **SIZES),
        _case("xglm", "XGLMForCausalLM", "XGLMConfig", "model.layers.1.fc2", d_model=32,
              num_layers=2, attention_heads=4, ffn_dim=64, **SIZES),
    ]  # fmt: skip


def _encoders() -> list[Case]:
    return [
        _case("bert", "BertForMaskedLM", "BertConfig", "bert.encoder.layer.1.output",
              "mlm", **BERT),
        _case("roberta", "RobertaForMaskedLM", "RobertaConfig", "roberta.encoder.layer.1.output",
              "mlm", **BERT),
        _case("deberta_v2", "DebertaV2ForMaskedLM", "DebertaV2Config",
              "deberta.encoder.layer.1.output", "mlm", relative_attention=True,
              pos_att_type=["p2c", "c2p"], **BERT),
        _case("modernbert", "ModernBertForMaskedLM", "ModernBertConfig", "model.layers.1.mlp",
              "mlm", local_attention=8, **BERT),
        _case("albert", "AlbertForMaskedLM", "AlbertConfig",
              "albert.encoder.albert_layer_groups.0.albert_layers.0.ffn_output", "mlm",
              embedding_size=16, **BERT),
        _case("distilbert", "DistilBertForMaskedLM", "DistilBertConfig",
              "distilbert.transformer.layer.1.ffn", "mlm", dim=32, hidden_dim=64, n_layers=2,
              n_heads=4, **SIZES),
    ]  # fmt: skip


def _encoder_decoders() -> list[Case]:
    return [
        _case("t5", "T5ForConditionalGeneration", "T5Config",
              "decoder.block.1.layer.2.DenseReluDense", "s2s", **T5),
        _case("switch_transformers", "SwitchTransformersForConditionalGeneration",
              "SwitchTransformersConfig", "encoder.block.1.layer.1.mlp.experts", "s2s",
              num_experts=4, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
              expert_capacity=32, **T5),
        _case("bart", "BartForConditionalGeneration", "BartConfig",
              "model.decoder.layers.1.fc2", "s2s", **BART),
        _case("marian", "MarianMTModel", "MarianConfig", "model.encoder.layers.1.fc2", "s2s",
              **(BART | {"decoder_start_token_id": PAD})),
        _case("nllb_moe", "NllbMoeForConditionalGeneration", "NllbMoeConfig",
              "model.decoder.layers.1.ffn", "s2s", num_experts=4, expert_capacity=64,
              encoder_sparse_step=2, decoder_sparse_step=2, **BART),
    ]  # fmt: skip


def _cases() -> list[Case]:
    lora = Case(
        name="llama_lora", build=_lora, batches=lambda g: lm_batches(g, STEPS), loss=_loss,
        fault="base_model.model.model.layers.1.mlp", recipe="hf",
    )  # fmt: skip
    return [*_decoders(), *_encoders(), *_encoder_decoders(), lora]


HF_CASES: list[Case] = _cases()
