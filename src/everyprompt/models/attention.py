"""The learner's attention on CUDA: transformers' SDPA attention with every backend of torch's but cuDNN's.

cuDNN's fused attention builds an execution plan, with kernels compiled at run time, for each new shape
of its inputs, and a learner's packed micro-batch changes width with nearly every batch. Measured on an
H200 (2026-11-28, torch 2.11.0+cu130, SmolLM2-135M, configs/smollm2.yaml with its 64 sequences in one
micro-batch; bench/learner_profile.py): an update at a width not seen before spent 0.59 s of host time in
cuDNN's forward and 1.20 s in its backward (30 calls each, one plan per width), where a whole update at a
width seen before took 0.37 s; at 16 sequences a micro-batch an update took 0.95 s with cuDNN's backend
and 0.95 s without it (the same batches, profiled after). Flash attention (rows that hold one sequence: causal,
no mask) and the memory-efficient kernel (packed rows: a mask) build nothing per shape.

Decided so rather than by padding widths to a few buckets (cuDNN then builds a plan per bucket, once a
run, and the padding costs compute), or PyTorch's `TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1` (an opt-in of
torch 2.9 and later that an environment variable must set before the first call; not measured here).

The choice is made per attention call (a registered attention function), so a gradient-checkpointed
layer's recomputation in the backward pass takes the same backends as its forward. Other devices keep
transformers' own SDPA attention.
"""

from __future__ import annotations

from torch import nn

CUDA_SDPA = "everyprompt_sdpa_cuda"  # the attention implementation `cuda_attention_without_cudnn` selects
# torch's SDPA backends the learner's attention may use on CUDA, in torch's own order of preference
BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def _sdpa_without_cudnn(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' SDPA attention with torch's backends restricted to `BACKENDS`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    with sdpa_kernel([getattr(SDPBackend, name) for name in BACKENDS]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)


def register() -> None:
    """Make `CUDA_SDPA` an attention implementation transformers knows (its masks: SDPA's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CUDA_SDPA, _sdpa_without_cudnn)
    AttentionMaskInterface.register(CUDA_SDPA, sdpa_mask)


def cuda_attention_without_cudnn(model: nn.Module) -> bool:
    """Give `model` (on a CUDA device, with SDPA attention) `_sdpa_without_cudnn`; True if it did."""
    device = next(model.parameters()).device
    config = getattr(model, "config", None)
    if device.type != "cuda" or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    register()
    model.set_attn_implementation(CUDA_SDPA)
    return True


def uses_sdpa(config) -> bool:
    """Whether a model of `config` attends with SDPA's masks as transformers builds them (its own SDPA
    attention or `CUDA_SDPA`): a packed micro-batch's mask may then be made on the host."""
    return getattr(config, "_attn_implementation", None) in ("sdpa", CUDA_SDPA)
