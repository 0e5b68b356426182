"""Tiny GGUF files made in the test, as llama.cpp's converter writes them: a 2-layer Llama with random
weights, a byte-level BPE tokenizer trained here in a second, and a ChatML chat template."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HEADS, KV_HEADS, LAYERS, HIDDEN, FFN = 4, 2, 2, 64, 128


def bpe_tokenizer():
    """A byte-level BPE (~300 tokens) trained on arithmetic sentences; specials first (ids 0, 1, 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = [f"What is {a} + {b}? The answer is {a + b}." for a in range(60) for b in range(20)]
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def llama_model(vocab_size: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of a q / k projection's rows (the rotary halves interleaved per head)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_llama_gguf(path: Path, model, tokenizer, quantization=None, architecture: str = "llama") -> Path:
    """`model` (a LlamaForCausalLM) and `tokenizer` (a `tokenizers.Tokenizer`) as a GGUF file; its matrices
    quantised to `quantization` (a gguf.GGMLQuantizationType; None: float32)."""
    import gguf

    vocab = tokenizer.get_vocab()
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merges = [
        m if isinstance(m, str) else " ".join(m) for m in json.loads(tokenizer.to_str())["model"]["merges"]
    ]
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny-llama")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHATML)
    weights = {name: value.numpy() for name, value in model.state_dict().items()}

    def add(name: str, value: np.ndarray) -> None:
        if quantization is not None and value.ndim == 2:
            try:
                data = gguf.quants.quantize(value, quantization)
            except (
                NotImplementedError
            ):  # a type gguf cannot write either: its bytes, zeros, of the right size
                data = np.zeros(gguf.quant_shape_to_byte_shape(value.shape, quantization), dtype=np.uint8)
            writer.add_tensor(name, data, raw_dtype=quantization)
        else:
            writer.add_tensor(name, value)

    add("token_embd.weight", weights["model.embed_tokens.weight"])
    for i in range(LAYERS):
        layer = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", weights[layer + "input_layernorm.weight"])
        add(f"blk.{i}.attn_q.weight", _permute(weights[layer + "self_attn.q_proj.weight"], HEADS))
        add(f"blk.{i}.attn_k.weight", _permute(weights[layer + "self_attn.k_proj.weight"], KV_HEADS))
        add(f"blk.{i}.attn_v.weight", weights[layer + "self_attn.v_proj.weight"])
        add(f"blk.{i}.attn_output.weight", weights[layer + "self_attn.o_proj.weight"])
        add(f"blk.{i}.ffn_norm.weight", weights[layer + "post_attention_layernorm.weight"])
        add(f"blk.{i}.ffn_gate.weight", weights[layer + "mlp.gate_proj.weight"])
        add(f"blk.{i}.ffn_up.weight", weights[layer + "mlp.up_proj.weight"])
        add(f"blk.{i}.ffn_down.weight", weights[layer + "mlp.down_proj.weight"])
    add("output_norm.weight", weights["model.norm.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
