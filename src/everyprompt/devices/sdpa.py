"""Which of torch's fused attention kernels the project's attention runs on CUDA: every one of
`scaled_dot_product_attention`'s backends but cuDNN's.

On Hopper and later, torch tries cuDNN's attention first. cuDNN builds an execution plan, with kernels
compiled at run time, for each new shape of its inputs, and its host time dwarfs its kernels'. Measured
on an H200 (2026-11-28, torch 2.11.0+cu130, SmolLM2-135M, bench/learner/learner_profile.py): over one profiled
update's 120 calls each way, 2.0 ms of host time a forward call and 1.8 ms a backward one, where the
device computed 16 and 33 us; and 0.59 s and 1.20 s for an update's 30 calls each at a width not
planned before. Flash attention (causal rows, no mask) and the memory-efficient kernel (a mask) build
nothing per shape.

Shapes that change all the time: a learner's packed micro-batch changes width with nearly every batch
(models/attention.py, and the transformers rollout engine's steps through the same function), and the
native rollout engine's prefill with each admission's longest prompt (rollout/native/decode_loop.py).
The RL step's rollout on the same card spent 75 ms a step in its prefill (bench/results/gpu_h200_2026-11-28/:
one forward of the step's 8 prompts, 30 attention calls, about what 30 of cuDNN's calls cost on the host);
not measured yet without cuDNN.

Not the native engine's decode step: it attends with a mask over grouped key/value heads, which of
torch's fused kernels only cuDNN's takes (flash attention takes no mask, the memory-efficient kernel no
grouped heads); without it the math backend would run, several kernels and the keys and values copied
per query head. Its static step's widths are fixed per graph bucket, so cuDNN plans each once, at the
capture.

Decided so rather than by padding widths to a few buckets (cuDNN then plans each bucket once a run, and
the padding costs compute), or by PyTorch's `TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1` (an opt-in of torch 2.9
and later that the environment must set before the first call; not measured here). Other devices keep
torch's own choice.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# torch's SDPA backends the project's attention may use on CUDA, in torch's own order of preference
BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def without_cudnn():
    """A context in which `scaled_dot_product_attention` chooses among `BACKENDS` only (some microseconds of
    host time to enter and leave)."""
    return sdpa_kernel(BACKENDS)


def attention_kernels(device: torch.device):
    """`without_cudnn()` on a CUDA device, else a context that does nothing (torch's choice stands)."""
    return without_cudnn() if device.type == "cuda" else contextlib.nullcontext()
