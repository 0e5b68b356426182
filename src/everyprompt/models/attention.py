"""The learner's attention on CUDA: transformers' SDPA attention with every backend of torch's but cuDNN's
(devices/sdpa.py: why, with the figures measured on an H200). A learner's packed micro-batch changes
width with nearly every batch, and cuDNN plans each new width: at 64 sequences a micro-batch an update at
a width not seen before spent 0.59 s of host time in cuDNN's forward and 1.20 s in its backward (30 calls
each), where a whole update at a width seen before took 0.37 s.

The choice is made per attention call (a registered attention function), so a gradient-checkpointed
layer's recomputation in the backward pass takes the same backends as its forward. Other devices keep
transformers' own SDPA attention.
"""

from __future__ import annotations

from torch import nn

from everyprompt.devices.sdpa import without_cudnn

CUDA_SDPA = "everyprompt_sdpa_cuda"  # the attention implementation `cuda_attention_without_cudnn` selects


def _sdpa_without_cudnn(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' SDPA attention without cuDNN's backend (devices/sdpa.py)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    with without_cudnn():
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
