"""Router record and replay for transformers' mixture-of-experts routers (docs/algorithms.md).

A replayed router uses given top-k expert indices instead of its own, while its gate weights are
recomputed from the live router logits over those experts (softmax, then the model's own top-k
renormalisation), so the router keeps its gradient. Index -1 in a row means "no route given": that token
keeps the router's own choice (the last token of a sequence, padding).

The hook sits on the router module's output `(router_logits, scores, indices)`, the interface shared by
the routers below; an unknown router is an error naming the architecture, not a silent no-op.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


class ReplayError(ValueError):
    """Replay asked of a model it cannot serve, or given indices that do not fit."""


# routers whose forward returns (logits, scores, indices); their gate weights are renormalised over the
# top-k when `norm_topk_prob` says so (Mixtral's router has no such switch and always renormalises)
_ROUTERS = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "OlmoeTopKRouter", "MixtralTopKRouter")


def same_expert_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[T, L] bool: whether routes a and b ([T, L, k] expert ids, any order within k) pick the same set."""
    return (a.long().sort(-1).values == b.long().sort(-1).values).all(-1)


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's known MoE routers in layer order; ReplayError naming the architecture if none."""
    routers = [m for m in model.modules() if type(m).__name__ in _ROUTERS]
    if not routers:
        raise ReplayError(
            f"{type(model).__name__}: no mixture-of-experts router that replay knows "
            f"(supported: {', '.join(sorted(_ROUTERS))})"
        )
    return routers


class RouterReplay:
    """Record the routers' choices, or make them replay given ones, during a forward pass."""

    def __init__(self, model: nn.Module):
        self.routers = moe_routers(model)
        self.top_k = self.routers[0].top_k
        self.num_experts = self.routers[0].num_experts

    @contextmanager
    def record(self) -> Iterator[list[torch.Tensor]]:
        """Yields a list that fills with each router's indices [N, k] (N = the forward's tokens)."""
        recorded: list[torch.Tensor] = []
        handles = [
            router.register_forward_hook(lambda _m, _i, out: recorded.append(out[2].detach().clone()))
            for router in self.routers
        ]
        try:
            yield recorded
        finally:
            for handle in handles:
                handle.remove()

    @contextmanager
    def replay(self, indices: torch.Tensor) -> Iterator[None]:
        """Make router l use `indices[:, l]` ([N, L_moe, k], -1 rows keep their own choice)."""
        if indices.dim() != 3 or indices.shape[1:] != (len(self.routers), self.top_k):
            raise ReplayError(
                f"replay indices must be [tokens, {len(self.routers)} MoE layers, top-{self.top_k}], "
                f"got {list(indices.shape)}"
            )
        indices = indices.long()
        if bool(((indices < -1) | (indices >= self.num_experts)).any()):
            raise ReplayError(
                f"replay indices must be expert ids in [0, {self.num_experts}) or -1, got values "
                f"{int(indices.min())}..{int(indices.max())}"
            )
        handles = [
            router.register_forward_hook(
                self._hook(indices[:, layer], bool(getattr(router, "norm_topk_prob", True)))
            )
            for layer, router in enumerate(self.routers)
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @staticmethod
    def _hook(given: torch.Tensor, normalise: bool):
        def hook(_module, _inputs, output):
            logits, _scores, own = output
            if given.shape[0] != own.shape[0]:
                raise ReplayError(
                    f"replay indices cover {given.shape[0]} tokens, the forward has {own.shape[0]}"
                )
            keep_own = (given[:, :1] < 0).expand_as(own)
            chosen = torch.where(keep_own, own, given)
            weights = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)
            if normalise:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), chosen

        return hook
