"""A training kernel for transformers' mixture-of-experts layers.

transformers runs an MoE layer's experts through one of its `experts_implementation`s; on CPU the
default (`grouped_mm`) gathers each expert's tokens and scatters the results back with advanced
indexing, whose backward is an accumulating `index_put` that runs serially. This kernel does the same
arithmetic with `index_select` / `index_add` (each the other's backward) around the same two grouped
matmuls: equal outputs and gradients (tests/models/test_experts.py), a training forward + backward
~15% faster on the demo model (docs/algorithms.md). It is registered with transformers' `ExpertsInterface` and selected
per model with `model.moe_kernel` (`everyprompt`, the default, or `transformers` for the stock one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

KERNEL_NAME = "everyprompt_sorted"


def sorted_experts_forward(
    module: nn.Module,
    hidden_states: torch.Tensor,  # [N, H]
    top_k_index: torch.Tensor,  # [N, k]
    top_k_weights: torch.Tensor,  # [N, k]
) -> torch.Tensor:
    """Sum over each token's k experts of weight x SwiGLU expert output, [N, H]."""
    top_k = top_k_index.shape[1]
    flat_experts = top_k_index.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)  # (token, k) pairs grouped by expert
    token_of_pair = order // top_k
    # a scatter, not bincount: bincount sizes its output by the largest id, a device sync on a GPU
    counts = torch.zeros(module.num_experts, dtype=torch.long, device=flat_experts.device)
    counts.scatter_add_(0, flat_experts, torch.ones_like(flat_experts))
    offsets = torch.cumsum(counts, 0).to(torch.int32)  # end of each expert's rows
    rows = hidden_states.index_select(0, token_of_pair)
    dtype = module.gate_up_proj.dtype
    wide = _products_dtype(dtype, hidden_states.device)
    gate_up = F.grouped_mm(
        rows.to(dtype).to(wide), module.gate_up_proj.to(wide).transpose(1, 2), offs=offsets
    ).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    out = F.grouped_mm(
        (module.act_fn(gate) * up).to(wide), module.down_proj.to(wide).transpose(1, 2), offs=offsets
    ).to(dtype)
    out = out * top_k_weights.reshape(-1).index_select(0, order)[:, None].to(out.dtype)
    return torch.zeros_like(hidden_states).index_add(0, token_of_pair, out.to(hidden_states.dtype))


def _products_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """What the experts' products run in for weights of `dtype`: float32 for bf16 weights on the CPU, whose
    bf16 grouped_mm grows the process by about 5 MB a call while routing changes (measured: 359 -> 677 MiB
    over 60 calls of the CPU twin's shapes, float32 flat; most of it oneDNN's primitive cache, one entry a
    group's row count: with it off, 311 -> 371 MiB). Widening bf16 operands is exact, and the float32 product rounded back
    to bf16 is what a bf16 kernel computes (it accumulates in float32)."""
    return torch.float32 if dtype == torch.bfloat16 and device.type == "cpu" else dtype


def _fits(module: nn.Module) -> bool:
    """The layout the kernel assumes: gate and up concatenated, [E, out, in] weights, no bias, no
    post-expert norm, all experts local. A layout flag the module lacks is refused; a feature flag it
    lacks is off: transformers 5.17 (a GPU image's) has no post-expert norm or expert parallelism flag."""
    return (
        getattr(module, "has_gate", False)
        and getattr(module, "is_concatenated", False)
        and not getattr(module, "has_bias", True)
        and not getattr(module, "is_transposed", True)
        and not getattr(module, "has_post_expert_norm", False)
        and not getattr(module, "_is_expert_parallel", False)
    )


def use_sorted_experts(model: nn.Module) -> bool:
    """Select the kernel for `model`'s experts if every experts module fits its layout; returns whether
    it did (a model without such modules, e.g. a dense one, keeps what it had)."""
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "has_gate")]
    if not experts or not all(_fits(m) for m in experts):
        return False
    register_sorted_experts()
    model.set_experts_implementation(KERNEL_NAME)
    return True


def register_sorted_experts() -> None:
    """Make the kernel known to transformers in this process (a config that names it, sent to another
    process, needs it there too before a model is built from it)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if KERNEL_NAME not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(KERNEL_NAME, sorted_experts_forward)


def select_moe_kernel(model: nn.Module, kernel: str) -> nn.Module:
    """Apply `model.moe_kernel` to a loaded policy: `everyprompt` selects the sorted kernel where it fits,
    `transformers` leaves the model as loaded. Returns the model."""
    if kernel == "everyprompt":
        use_sorted_experts(model)
    return model
