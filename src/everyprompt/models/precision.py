"""Training precision and activation memory (`model.dtype`, `model.gradient_checkpointing`).

`bf16` runs the trainer's forward passes (SFT, the RL loss, old-policy and reference log-probs) under
`torch.autocast`: matrix products in bfloat16, while the weights, their gradients and the optimizer state
stay float32, so the fp32 weights are the master copy and small updates are not rounded away (the mixed
precision of torch AMP and the HF Trainer's `bf16=True`). Log-softmax runs in float32 either way
(trainer/logprobs.py). Decided so, rather than bf16 weights with a separate fp32 master copy in the
optimizer, because it keeps one copy of the weights, checkpoints stay fp32 and exact on resume, and the
weight sync hands the engine the same tensors as in fp32; what it saves is activation memory and matmul
time where bf16 kernels are fast, not weight memory (docs/training.md has the measurements).

Gradient checkpointing is transformers' own (`activation_checkpointing_enable`, non-reentrant): each decoder
layer's activations are recomputed in the backward pass instead of kept.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from everyprompt.devices import default_dtype
from everyprompt.errors import InputError

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


def autocast(model: nn.Module, dtype: str):
    """The context the trainer's forwards of `model` run under for `model.dtype` = `dtype`."""
    device = next(model.parameters()).device
    low = TRAINING_DTYPES[training_dtype(dtype, device)]
    if low is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=low)


def enable_gradient_checkpointing(model: nn.Module) -> nn.Module:
    """Recompute each decoder layer's activations in the backward pass (transformers' non-reentrant
    checkpointing); a PrecisionError naming the architecture if it has none."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise PrecisionError(
            f"config key 'model.gradient_checkpointing': {type(model).__name__} does not support it"
        )
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x names it so
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model
