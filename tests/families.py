"""Tiny random checkpoints of every model family everyprompt is tested on, built from transformers
configs (a few layers, hidden size 32) with the character tokenizer's vocabulary."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from everyprompt.models.tokenizer import build_char_tokenizer

_LAYERS = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2)

# model_type -> config keywords beyond the shared layer stack
FAMILY_CONFIGS: dict[str, dict] = {
    "llama": dict(intermediate_size=64, attention_bias=True),
    "qwen2": dict(intermediate_size=64),
    "qwen3": dict(intermediate_size=64, head_dim=8),
    "qwen3_moe": dict(
        intermediate_size=64, moe_intermediate_size=16, norm_topk_prob=True, head_dim=8, **_MOE
    ),
    "qwen2_moe": dict(
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        norm_topk_prob=False,
        **_MOE,
    ),
    "mixtral": dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(intermediate_size=16, norm_topk_prob=False, clip_qkv=4.0, **_MOE),
    "deepseek_v3": dict(
        intermediate_size=64,
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        num_hidden_layers=3,
        num_key_value_heads=4,  # multi-head latent attention: one key per query head
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "gpt_oss": dict(
        intermediate_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=8,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    ),
}
EAGER_ONLY = ("gpt_oss", "gemma2")  # transformers has no sdpa path for these (attention sinks, soft-capping)
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss")


def family_config(model_type: str, **overrides):
    tokenizer = build_char_tokenizer()
    ids = dict(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    family = FAMILY_CONFIGS.get(model_type, {})  # a family not listed: the shared stack and `overrides`
    return AutoConfig.for_model(model_type, **{**_LAYERS, **family, **ids, **overrides})


def family_model(model_type: str, seed: int = 0, **overrides):
    """A random-init model of `model_type` (weights N(0, 0.2) so outputs vary by token) and the char
    tokenizer; eval mode, fp32."""
    tokenizer = build_char_tokenizer()
    config = family_config(model_type, **overrides)
    torch.manual_seed(seed)
    attention = "eager" if model_type in EAGER_ONLY else "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.dim() >= 2 or "bias" in name and tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.2)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval(), tokenizer


def save_family_checkpoint(model_type: str, directory, seed: int = 0, **overrides):
    model, tokenizer = family_model(model_type, seed, **overrides)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def save_chat_checkpoint(directory, corpus: list[str], model_type: str = "qwen3_moe", seed: int = 0):
    """A tiny random checkpoint of `model_type` with a byte-level BPE tokenizer trained on `corpus`, whose
    chat template has a system turn and an `enable_thinking` switch (models/tokenizer.py)."""
    from everyprompt.models.tokenizer import build_chat_tokenizer

    tokenizer = build_chat_tokenizer(corpus, vocab_size=400)
    config = family_config(
        model_type,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory
