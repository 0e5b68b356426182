"""AdamW and the learning-rate schedule (linear warm-up, then constant or cosine)."""

from __future__ import annotations

import math

import torch


def build_optimizer(model, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99), eps=1e-8)


def build_scheduler(optimizer, warmup_steps: int, total_steps: int, schedule: str = "constant"):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if schedule == "cosine" and total_steps > warmup_steps:
            progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
