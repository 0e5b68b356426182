"""Training precision and activation memory (`model.dtype`, `model.gradient_checkpointing`).

`bf16` runs the trainer's forward passes (SFT, the RL loss, old-policy and reference log-probs) under
`torch.autocast`: matrix products in bfloat16, while the weights, their gradients and the optimizer state
stay float32, so the fp32 weights are the master copy and small updates are not rounded away (the mixed
precision of torch AMP and the HF Trainer's `bf16=True`). Log-softmax runs in float32 either way
(trainer/learner_side/logprobs.py). Decided so, rather than bf16 weights with a separate fp32 master copy in the
optimizer, because it keeps one copy of the weights, checkpoints stay fp32 and exact on resume, and the
weight sync hands the engine the same tensors as in fp32; what it saves is activation memory and matmul
time where bf16 kernels are fast, not weight memory (docs/training.md has the measurements).

Where a CPU has no fast bf16 instructions (AVX2 only) the products run in `EmulatedBf16` as well
(`model.cpu_bf16`, models/emulated_bf16.py): torch's float32 kernels on bf16-rounded operands, the result
rounded to bf16, the same format at float32 speed (gradient checkpointing's recomputation included).

On the CPU under bf16 autocast the attention itself (softmax(QK^T)V) runs in float32 (`cpu_attention_in_fp32`):
torch's CPU flash-attention backward is about three times slower in bf16 than in fp32 (SmolLM2's shapes,
16 x 143 tokens: 36.7 ms against 12.5 ms a layer), and the float32 softmax is the more precise one. The
projections around it stay bf16. GPUs keep bf16 attention.

Gradient checkpointing is transformers' own (`activation_checkpointing_enable`, non-reentrant): each decoder
layer's activations are recomputed in the backward pass instead of kept.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from everyprompt.devices import default_dtype
from everyprompt.devices.bf16 import SLOW, cpu_bf16_slowdown
from everyprompt.errors import InputError
from everyprompt.models import compiled_layers, liger  # noqa: F401  (they register their layer kernels)
from everyprompt.models.attention import cuda_attention_without_cudnn
from everyprompt.models.emulated_bf16 import emulated_if, recompute_context
from everyprompt.models.experts import select_moe_kernel
from everyprompt.models.kernels import apply_kernels

TRAINING_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}


class PrecisionError(InputError):
    """A training precision or memory setting this model cannot take."""


def training_dtype(dtype: str, device: torch.device) -> str:
    """`model.dtype` as it applies on `device`: `auto` is bf16 on CUDA, fp32 on the CPU."""
    if dtype == "auto":
        return default_dtype(device)
    if dtype not in TRAINING_DTYPES:
        raise PrecisionError(
            f"model.dtype must be auto or one of {', '.join(TRAINING_DTYPES)}, got {dtype!r}"
        )
    return dtype


def frozen_dtype(model_config, device: torch.device) -> torch.dtype:
    """The dtype weights no update touches (a LoRA policy's base, a distillation teacher) are held in on
    `device` (`model.frozen_dtype`). No master copy is needed for weights that never change, so bf16 halves
    their memory at no cost to the update; their forward becomes a bf16 model's (norms and residual adds in
    bf16 too, where float32 weights under autocast keep them in float32), as peers' LoRA on a bf16 base
    computes.

    `auto`: bf16 on CUDA when training in bf16, else float32: a CPU trains models whose weights' bytes
    matter little (docs/training.md: the CPU twin's LoRA step on a bf16 base, a tenth less step memory,
    no faster), and the registered CPU evidence ran so. A sharded policy (fsdp2) holds its base as an
    unsharded one does: fully_shard gathers a layer of mixed dtypes as bytes, and its startup checks run
    on a float32 copy gathered a layer at a time (models/slices.py)."""
    if model_config.frozen_dtype != "auto":
        return torch.bfloat16 if model_config.frozen_dtype == "bf16" else torch.float32
    if device.type != "cuda":
        return torch.float32
    return TRAINING_DTYPES[training_dtype(model_config.dtype, device)] or torch.float32


def hold_parameters_in(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` with every floating-point parameter cast to `dtype` in place, the same Parameter objects;
    buffers keep theirs (rotary frequencies stay float32, as transformers computes them)."""
    for parameter in model.parameters():
        if parameter.is_floating_point() and parameter.dtype != dtype:
            parameter.data = parameter.data.to(dtype)
    return model


@contextlib.contextmanager
def parameters_in_float32(model: nn.Module):
    """Within it, every parameter of `model` is float32; afterwards each has its own dtype again, its
    values unchanged (bf16 -> fp32 -> bf16 is exact). What an fp32 comparison of a model with a bf16 base
    runs under (the startup parity check). For its duration the model takes float32 memory."""
    held = {
        parameter: parameter.dtype
        for parameter in model.parameters()
        if parameter.is_floating_point() and parameter.dtype != torch.float32
    }
    for parameter in held:  # a float32 model's are not touched (a sharded one's could not be)
        parameter.data = parameter.data.float()
    try:
        yield model
    finally:
        for parameter, dtype in held.items():
            parameter.data = parameter.data.to(dtype)


def emulates_bf16(device: torch.device, dtype: str, cpu_bf16: str = "auto") -> bool:
    """Whether training at `model.dtype` = `dtype` on `device` computes its bf16 products with float32
    kernels (`model.cpu_bf16`: emulated, native, or auto: emulated where a bf16 product takes SLOW times an
    fp32 one or more on this CPU, measured once a process)."""
    if device.type != "cpu" or training_dtype(dtype, device) != "bf16":
        return False
    if cpu_bf16 == "auto":
        return cpu_bf16_slowdown() >= SLOW
    return cpu_bf16 == "emulated"


@contextlib.contextmanager
def autocast(model: nn.Module, dtype: str, cpu_bf16: str = "auto"):
    """The context the trainer's forwards of `model` run under for `model.dtype` = `dtype` (and
    `model.cpu_bf16` = `cpu_bf16`)."""
    device = next(model.parameters()).device
    low = TRAINING_DTYPES[training_dtype(dtype, device)]
    if low is None:
        yield
        return
    emulate = emulates_bf16(device, dtype, cpu_bf16)  # before autocast: `auto` may measure products
    with torch.autocast(device_type=device.type, dtype=low), emulated_if(emulate):
        yield


FP32_CPU_SDPA = "everyprompt_sdpa_fp32_cpu"  # the attention implementation `cpu_attention_in_fp32` selects


def _sdpa_fp32_under_cpu_autocast(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' SDPA attention, in float32 when called on the CPU under autocast (else unchanged)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    with torch.autocast("cpu", enabled=False):
        query, key, value = query.float(), key.float(), value.float()
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)


def cpu_attention_in_fp32(model: nn.Module, dtype: str) -> bool:
    """Give `model` (on the CPU, trained in bf16, with SDPA attention) float32 attention under autocast
    (see the module docstring); True if it did. Its forwards outside autocast are unchanged."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    device = next(model.parameters()).device
    config = getattr(model, "config", None)
    if device.type != "cpu" or training_dtype(dtype, device) != "bf16":
        return False
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(FP32_CPU_SDPA, _sdpa_fp32_under_cpu_autocast)
    AttentionMaskInterface.register(FP32_CPU_SDPA, sdpa_mask)
    model.set_attn_implementation(FP32_CPU_SDPA)
    return True


def enable_gradient_checkpointing(model: nn.Module) -> nn.Module:
    """Recompute each decoder layer's activations in the backward pass (transformers' non-reentrant
    checkpointing); a PrecisionError naming the architecture if it has none."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise PrecisionError(
            f"config key 'model.gradient_checkpointing': {type(model).__name__} does not support it"
        )
    kwargs = {"use_reentrant": False, "context_fn": recompute_context}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x names it so
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def forward_kernels(model: nn.Module, model_config) -> nn.Module:
    """`model` (already on the learner's device) with the kernels of the learner's forwards: the MoE
    experts' (`model.moe_kernel`), float32 attention on the CPU under bf16, and on CUDA attention without
    cuDNN's backend (models/attention.py). A frozen model the learner
    scores with (a distillation teacher) gets these, so that it computes as the policy does."""
    select_moe_kernel(model, model_config.moe_kernel)
    cpu_attention_in_fp32(model, model_config.dtype)
    cuda_attention_without_cudnn(model)
    return model


def training_kernels(model: nn.Module, model_config) -> nn.Module:
    """`model` (already on its training device) with the kernels `model_config` trains it with: the
    forward kernels (`forward_kernels`), its layers' (`model.kernels`, models/kernels.py) and gradient
    checkpointing."""
    forward_kernels(model, model_config)
    apply_kernels(model, model_config.kernels)
    if model_config.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model
