"""Tiny model presets: transformers architectures at a size that trains on two CPU cores."""

from __future__ import annotations

from transformers import LlamaConfig, Qwen3MoeConfig

from everyprompt.config import ModelConfig


def tiny_moe_config(
    model: ModelConfig, vocab_size: int, pad_id: int, bos_id: int, eos_id: int
) -> Qwen3MoeConfig:
    """A Qwen3-MoE config of a few M parameters: every layer sparse, `top_k` of `num_experts` experts."""
    head_dim = model.hidden_size // model.num_heads
    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=4 * model.hidden_size,
        moe_intermediate_size=model.moe_intermediate_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_heads,
        num_key_value_heads=model.num_kv_heads,
        head_dim=head_dim,
        num_experts=model.num_experts,
        num_experts_per_tok=model.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        output_router_logits=False,
        router_aux_loss_coef=0.0,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        attn_implementation="sdpa",
    )


def tiny_dense_config(vocab_size: int, pad_id: int, bos_id: int, eos_id: int) -> LlamaConfig:
    """A 2-layer dense Llama without biases (the shape `everyprompt upcycle` takes), for smoke runs."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
