"""AdamW, the learning-rate schedule (linear warm-up, then constant or cosine), and the error that stops a
run whose updates keep coming out non-finite."""

from __future__ import annotations

import math

import torch

from everyprompt.errors import RunError


class NumericsError(RunError):
    """Updates kept coming out non-finite: the run stops rather than train on garbage."""


def build_optimizer(model, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters: on CUDA its fused kernel (one launch per step for all
    parameters, no host work per tensor), elsewhere torch's default implementation."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = fused_on(params)
    return torch.optim.AdamW(
        params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99), eps=1e-8, fused=fused or None
    )


def fused_on(params: list[torch.Tensor]) -> bool:
    """Whether AdamW runs fused: every parameter on a real CUDA device (a fake one, in tests, has none)."""
    return bool(params) and torch.cuda.is_available() and all(p.device.type == "cuda" for p in params)


def build_scheduler(optimizer, warmup_steps: int, total_steps: int, schedule: str = "constant"):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if schedule == "cosine" and total_steps > warmup_steps:
            progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
