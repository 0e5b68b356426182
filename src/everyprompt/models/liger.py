"""Liger's Triton training kernels in the learner's forwards (`model.kernels=liger`, CUDA only).

Liger (the `liger-kernel` package, `pip install 'everyprompt[kernels]'`) fuses a decoder layer's RMSNorm,
SwiGLU (SiLU times up) and rotary embedding into one Triton kernel each, forward and backward, where
torch runs several elementwise kernels. On a GPU a small model's learner is bound by the host's kernel
launches (an H200 computed 86 ms of a 0.95 s SmolLM2 update: docs/gpu-runs.md), so fewer kernels is the lever.
Whether it pays is for a lent GPU to say (the learner profile's `liger` variant); until then it is off.

Applied to the policy instance (its norms and MLPs) with Liger's own patching, which also replaces the
family's rotary function and its norm and MLP classes in transformers' module: every model of that family
in the process uses them from then on (a KL reference, a teacher: on the same device, alike). The LM head
stays everyprompt's chunked log-prob head: Liger's fused linear cross entropy computes a loss the RL
objective does not use. Liger's kernels are exact in the sense its
authors test (against transformers' modules within the dtype's tolerance); the `gpu` test compares an
update with and without them.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from everyprompt.models.kernels import KernelsError, register_kernels


def check_liger(device: torch.device) -> None:
    """A KernelsError, before any work, where Liger's kernels cannot run on `device` or are not installed."""
    if device.type != "cuda":
        raise KernelsError(
            f"config key 'model.kernels': liger's kernels are Triton kernels for CUDA devices; the learner "
            f"runs on {device} (model.kernels=torch there)"
        )
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        raise KernelsError(
            "config key 'model.kernels': liger needs the liger-kernel package: pip install 'everyprompt[kernels]'"
        ) from None


def apply_liger(model: nn.Module) -> None:
    """Liger's RMSNorm, SwiGLU and rotary kernels in `model` (on CUDA; `check_liger` first). A model type
    Liger has no kernels for is a KernelsError naming it."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    base = getattr(model, "get_base_model", lambda: model)()  # a LoRA policy: the model inside
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        raise KernelsError(
            f"config key 'model.kernels': Liger has no kernels for model type {model_type!r} "
            f"(it has: {', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))})"
        )
    wanted = dict(
        rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
    )
    accepted = inspect.signature(apply).parameters  # each family's function takes its own kernels
    apply(model=base, **{name: value for name, value in wanted.items() if name in accepted})


register_kernels("liger", check_liger, apply_liger)
