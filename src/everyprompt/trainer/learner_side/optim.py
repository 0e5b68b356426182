"""AdamW, the learning-rate schedule (linear warm-up, then constant or cosine), their owner in the learner
(`Optimization`), and the error that stops a run whose updates keep coming out non-finite."""

from __future__ import annotations

import logging
import math
import warnings
from pathlib import Path

import torch

from everyprompt.errors import RunError
from everyprompt.trainer.checkpoint import load_optimizer_state, portable_optimizer_state

log = logging.getLogger(__name__)


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


class Optimization:
    """The policy's AdamW, its schedule and the count of updates skipped in a row for non-finite numbers:
    what a mini-batch step takes or skips, and what a checkpoint keeps of them."""

    def __init__(self, model, rl):
        self.model, self.max_grad_norm, self.max_skipped = model, rl.max_grad_norm, rl.max_skipped_updates
        self.optimizer = build_optimizer(model, rl.lr, rl.weight_decay)
        self.scheduler = build_scheduler(self.optimizer, rl.warmup_steps, rl.steps, rl.lr_schedule)
        self.consecutive_skips = 0

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def clip_gradients(self) -> torch.Tensor:
        """The gradients clipped to `rl.max_grad_norm`; their norm before, a 0-dim tensor on the device
        (whole under fsdp2: its DTensor's full value)."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def step(self) -> None:
        self.optimizer.step()
        self.consecutive_skips = 0

    def skip(self, version: int, what: str, value: float) -> dict[str, float]:
        """Drop this mini-batch's update (its gradient is not finite); stop after too many in a row."""
        self.zero_grad()
        self.consecutive_skips += 1
        log.warning("update %d: %s is %s; this mini-batch's update is skipped", version, what, value)
        if self.consecutive_skips >= self.max_skipped:
            raise NumericsError(
                f"{self.consecutive_skips} updates in a row were skipped for a non-finite loss or gradient norm "
                f"(last: {what} = {value}; rl.max_skipped_updates={self.max_skipped}); lower rl.lr "
                "or look for the batch that produces it"
            )
        return {"actor/skipped_updates": 1.0}

    def advance_schedule(self) -> None:
        """One schedule step per update with signal, also when its optimizer step was skipped (non-finite)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler")
            self.scheduler.step()

    def state(self, sharded: bool, shards: Path | None) -> dict:
        """The optimizer's state by parameter name (trainer/checkpoint.py: any rank count resumes it), the
        schedule's and the skip count."""
        return {
            "consecutive_skips": self.consecutive_skips,
            "optimizer": portable_optimizer_state(self.model, self.optimizer, sharded, shards),
            "scheduler": self.scheduler.state_dict(),
        }

    def load(self, state: dict) -> None:
        self.consecutive_skips = state["consecutive_skips"]
        load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
