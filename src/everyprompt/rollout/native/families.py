"""The model families the native engine implements, and the settings of each it does not.

A family is a transformers `model_type` and the few ways its layers differ from the others: the
attention variant (grouped-query, or DeepSeek's multi-head latent attention), how query and key are
normalised, how the router picks and weighs experts, whether an MoE layer adds a shared expert (gated or
not), whether the router's top-k weights are renormalised. Biases are read wherever the checkpoint has
them. Any config setting outside what the engine
computes is refused by name when the model loads (`unsupported_settings`), never ignored: a model with it
runs on `rollout.engine=hf`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from everyprompt.rollout.base import UnsupportedModelError


@dataclass(frozen=True)
class Family:
    attention: Literal["grouped", "latent"] = "grouped"  # a key of attention.ATTENTIONS
    qk_norm: Literal["head", "full", "none"] = "none"  # per head (Qwen3), over all heads (OLMoE), none
    router: Literal["softmax", "grouped_sigmoid"] = "softmax"  # a key of moe.ROUTERS
    # "gated": sigmoid(x @ gate) * SwiGLU(x) added to the routed experts (Qwen2-MoE); "plain": SwiGLU(x)
    # added (DeepSeek-V3's shared_experts); None: no shared expert
    shared_expert: Literal["gated", "plain"] | None = None
    renormalise: bool | None = None  # router top-k weights renormalised; None: the config's norm_topk_prob


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "qwen2": Family(),
    "qwen3": Family(qk_norm="head"),
    "qwen3_moe": Family(qk_norm="head"),
    "qwen2_moe": Family(shared_expert="gated"),
    "mixtral": Family(renormalise=True),
    "olmoe": Family(qk_norm="full"),
    "deepseek_v3": Family(attention="latent", router="grouped_sigmoid", shared_expert="plain"),
}

ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # position-independent frequency tables


def check_family(config) -> None:
    """UnsupportedModelError naming every setting of `config` the native engine does not compute."""
    if getattr(config, "model_type", None) not in FAMILIES:
        raise UnsupportedModelError(
            f"the native engine runs model_type {', '.join(FAMILIES)}, not {config.model_type!r}"
        )
    found = unsupported_settings(config)
    if found:
        raise UnsupportedModelError(
            f"the native engine does not implement {'; '.join(found)} (model_type {config.model_type})"
        )


def unsupported_settings(config) -> list[str]:
    """Each setting of `config` the native engine does not compute, as `name=value` (empty: it runs)."""
    found = []
    if getattr(config, "hidden_act", "silu") != "silu":
        found.append(f"hidden_act={config.hidden_act!r}")
    if getattr(config, "mlp_bias", False):
        found.append("mlp_bias=True")
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        found.append(f"rope_parameters.rope_type={rope_type!r}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        found.append(f"rope_parameters.partial_rotary_factor={rope['partial_rotary_factor']}")
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        kinds = sorted({kind for kind in layer_types if kind != "full_attention"})
        found.append(f"layer_types with {', '.join(kinds)}")
    elif getattr(config, "use_sliding_window", False) or (
        config.model_type == "mixtral" and getattr(config, "sliding_window", None) is not None
    ):
        found.append(f"sliding_window={getattr(config, 'sliding_window', None)}")
    if config.model_type == "deepseek_v3" and config.num_key_value_heads != config.num_attention_heads:
        found.append(
            f"num_key_value_heads={config.num_key_value_heads} != num_attention_heads"
            f"={config.num_attention_heads} (latent attention has one key per query head)"
        )
    if config.model_type == "olmoe":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if head_dim * config.num_attention_heads != config.hidden_size:
            found.append(f"head_dim={head_dim} with num_attention_heads * head_dim != hidden_size")
    return found


def rope_tables(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] and the cos/sin scale of the config's rotary embedding, as
    transformers computes them for the model (default, linear, llama3 or yarn)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = config.rope_parameters
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        theta = rope["rope_theta"]
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    return inv_freq.float(), float(scale)
