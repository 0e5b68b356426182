"""Name -> function registries for advantage estimators and policy losses."""

from __future__ import annotations

from collections.abc import Callable

import torch

from everyprompt.algorithms.aggregation import aggregate

_ADVANTAGES: dict[str, Callable] = {}
_POLICY_LOSSES: dict[str, Callable] = {}


def _register(table: dict[str, Callable], kind: str, name: str) -> Callable[[Callable], Callable]:
    def decorate(fn: Callable) -> Callable:
        if name in table:
            raise ValueError(f"{kind} {name!r} is already registered")
        table[name] = fn
        return fn

    return decorate


def _lookup(table: dict[str, Callable], kind: str, name: str) -> Callable:
    if name not in table:
        raise KeyError(f"unknown {kind} {name!r}; valid: {', '.join(sorted(table))}")
    return table[name]


def register_advantage(name: str) -> Callable[[Callable], Callable]:
    return _register(_ADVANTAGES, "advantage estimator", name)


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    return _register(_POLICY_LOSSES, "policy loss", name)


def registered_advantages() -> list[str]:
    return sorted(_ADVANTAGES)


def registered_policy_losses() -> list[str]:
    return sorted(_POLICY_LOSSES)


def compute_advantages(
    name: str,
    rewards: torch.Tensor,  # [N] float, NaN where the reward is None
    group_index: torch.Tensor,  # [N] long, the prompt group of each completion
    **options,
) -> torch.Tensor:  # [N]
    """Per-completion advantages from the estimator registered as `name`."""
    return _lookup(_ADVANTAGES, "advantage estimator", name)(rewards, group_index, **options)


def policy_loss(
    name: str,
    logp: torch.Tensor,  # [B, T] log-probs under the policy being trained
    old_logp: torch.Tensor,  # [B, T] log-probs under the policy that sampled (detached)
    advantages: torch.Tensor,  # [B] or [B, T]
    mask: torch.Tensor,  # [B, T] 1 on completion tokens
    *,
    agg: str = "token-mean",
    max_length: int | None = None,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    **options,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar loss and detached metrics: the registered per-token objective, then its aggregation.

    `num_tokens` / `num_sequences` are the denominators of the whole mini-batch when this call sees one
    micro-batch of it (see :func:`aggregate`).
    """
    fn = _lookup(_POLICY_LOSSES, "policy loss", name)
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    token_loss, metrics = fn(logp, old_logp, advantages, mask, **options)
    loss = aggregate(
        token_loss, mask, agg, max_length=max_length, num_tokens=num_tokens, num_sequences=num_sequences
    )
    return loss, metrics
