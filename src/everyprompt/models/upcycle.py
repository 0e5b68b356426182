"""Sparse upcycling: a dense Llama-family checkpoint into a Mixtral mixture-of-experts checkpoint.

Each decoder layer's MLP is copied into `experts` identical experts and a router is added; everything else
(embeddings, attention, norms, head) is carried over as it is. Mixtral renormalises its top-k routing
weights to sum to one, so with identical experts the layer's output equals the dense MLP's whatever the
router says: the upcycled model starts with the dense model's logits (equal within float rounding, tested
to 1e-5), and RL then lets the experts drift apart. The router starts from small random weights (seeded)
rather than zeros, so that tokens are spread over the experts from the first step instead of tying on the
first k (Komatsuzaki et al., "Sparse Upcycling", 2022, initialise the router the same way).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import MixtralConfig, MixtralForCausalLM

from everyprompt.models.io import ModelError, load_pretrained
from everyprompt.run.files import check_new_dir, write_dir_atomic

DENSE_FAMILIES = ("llama", "mistral")  # SwiGLU MLPs (gate, up, down) and attention without biases, as Mixtral
ROUTER_STD = 0.02  # the router's initial weights: normal(0, ROUTER_STD), seeded


class UpcycleError(ModelError):
    """The model cannot be upcycled; the message names it and why."""


def mixtral_config(dense, experts: int, top_k: int) -> MixtralConfig:
    """The Mixtral config of `dense`'s architecture with `experts` experts of its MLP width, top-`top_k`."""
    if dense.model_type not in DENSE_FAMILIES:
        raise UpcycleError(
            f"model_type {dense.model_type!r} cannot be upcycled; supported: {', '.join(DENSE_FAMILIES)}"
        )
    if getattr(dense, "mlp_bias", False) or getattr(dense, "attention_bias", False):
        raise UpcycleError("the model's MLP or attention has biases, which Mixtral layers do not")
    if not 1 <= top_k <= experts:
        raise UpcycleError(f"--top-k {top_k}: expected 1 <= top-k <= experts ({experts})")
    shared = {
        key: getattr(dense, key)
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "hidden_act",
            "max_position_embeddings",
            "rms_norm_eps",
            "rope_parameters",
            "tie_word_embeddings",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
            "attention_dropout",
        )
        if hasattr(dense, key)
    }
    return MixtralConfig(
        **shared,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        sliding_window=None,
        router_aux_loss_coef=0.0,
        output_router_logits=False,
    )


def upcycled_state(dense_state: dict[str, torch.Tensor], moe_state: dict[str, torch.Tensor], seed: int):
    """The MoE model's state: the dense tensors where the names agree, every expert a copy of its layer's
    MLP (gate and up stacked as the fused `gate_up_proj`), the routers random (seeded)."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, target in moe_state.items():
        layer = name.split(".mlp.")[0] if ".mlp." in name else None
        if name in dense_state:
            out[name] = dense_state[name].clone()
        elif name.endswith("mlp.experts.gate_up_proj"):  # [E, 2 * I, H]
            fused = torch.cat(
                [dense_state[f"{layer}.mlp.gate_proj.weight"], dense_state[f"{layer}.mlp.up_proj.weight"]]
            )
            out[name] = fused.unsqueeze(0).expand_as(target).clone()
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            out[name] = dense_state[f"{layer}.mlp.down_proj.weight"].unsqueeze(0).expand_as(target).clone()
        elif name.endswith("mlp.gate.weight"):  # the router, [E, H]
            out[name] = torch.randn(target.shape, generator=generator) * ROUTER_STD
        else:
            raise UpcycleError(f"the Mixtral layout has {name!r}, which upcycling does not know how to fill")
    return out


def upcycle_model(dense, experts: int, top_k: int, seed: int = 0) -> MixtralForCausalLM:
    """The sparse upcycle of a loaded dense model (fp32)."""
    config = mixtral_config(dense.config, experts, top_k)
    moe = MixtralForCausalLM(config)  # (on the CPU: its non-persistent buffers, e.g. RoPE's, are computed)
    dense_state = dense.state_dict()
    if config.tie_word_embeddings:
        dense_state.setdefault("lm_head.weight", dense_state["model.embed_tokens.weight"])
    state = upcycled_state(dense_state, moe.state_dict(), seed)
    moe.load_state_dict(state)
    if config.tie_word_embeddings:
        moe.tie_weights()
    moe.generation_config = dense.generation_config
    return moe.eval()


def upcycle(dense_path: str | Path, out_dir: str | Path, experts: int, top_k: int, seed: int = 0) -> Path:
    """Write the sparse upcycle of the checkpoint (or .gguf file) at `dense_path` as a Mixtral checkpoint
    with its tokenizer into `out_dir` (atomically; it must not exist or be empty)."""
    check_new_dir(out_dir, UpcycleError)
    dense, tokenizer = load_pretrained(dense_path)
    try:
        moe = upcycle_model(dense, experts, top_k, seed)
    except UpcycleError as err:
        raise UpcycleError(f"{dense_path}: {err}") from None

    def write(folder: Path) -> None:
        moe.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)

    return write_dir_atomic(out_dir, write, UpcycleError)
