"""Router record and replay for transformers' mixture-of-experts routers (docs/algorithms.md).

A replayed router uses given top-k expert indices instead of its own, while its gate weights are
recomputed from the live router logits over those experts by the router's own gate function (softmax
then optional renormalisation for Qwen / Mixtral / OLMoE; sigmoid, renormalisation and scaling for
DeepSeek-V3; softmax over the chosen logits for GPT-OSS), so the router keeps its gradient. Index -1 in a
row means "no route given": that token keeps the router's own choice (the last token of a sequence,
padding).

The hook sits on the router module's output `(router_logits, gate_weights, indices)`, the interface
shared by transformers' routers; each router class is registered with its gate function in `GATES`, and
an unknown router is an error naming the architecture, not a silent no-op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn


class ReplayError(ValueError):
    """Replay asked of a model it cannot serve, or given indices that do not fit."""


GateFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def softmax_gates(router: nn.Module, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Softmax over all experts, taken at the chosen ones, renormalised over them when the router's
    `norm_topk_prob` says so (Mixtral's router has no such switch and always renormalises)."""
    weights = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


def sigmoid_gates(router: nn.Module, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3: sigmoid scores at the chosen experts (the score-correction bias only steers the
    choice, never the weights), renormalised when `norm_topk_prob`, times `routed_scaling_factor`."""
    weights = torch.sigmoid(logits.float()).gather(-1, chosen)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


def chosen_softmax_gates(_router: nn.Module, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """GPT-OSS: softmax over the chosen experts' logits alone."""
    return torch.softmax(logits.float().gather(-1, chosen), dim=-1)


# router class name -> how its gate weights follow from its logits and chosen experts
GATES: dict[str, GateFn] = {
    "Qwen3MoeTopKRouter": softmax_gates,
    "Qwen2MoeTopKRouter": softmax_gates,
    "OlmoeTopKRouter": softmax_gates,
    "MixtralTopKRouter": softmax_gates,
    "DeepseekV3TopkRouter": sigmoid_gates,
    "GptOssTopKRouter": chosen_softmax_gates,
}


def same_expert_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[T, L] bool: whether routes a and b ([T, L, k] expert ids, any order within k) pick the same set."""
    return (a.long().sort(-1).values == b.long().sort(-1).values).all(-1)


def gate_function(module: nn.Module):
    """The gate function of a router module's class or of a class it derives from (a router with a
    LoRA adapter on its weight is a parametrized subclass of its own class), else None."""
    return next((GATES[c.__name__] for c in type(module).__mro__ if c.__name__ in GATES), None)


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The model's known MoE routers in layer order (empty for a dense model)."""
    return [m for m in model.modules() if gate_function(m) is not None]


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's known MoE routers in layer order; ReplayError naming the architecture if none."""
    routers = find_routers(model)
    if not routers:
        raise ReplayError(
            f"{type(model).__name__}: no mixture-of-experts router that replay knows "
            f"(supported: {', '.join(sorted(GATES))})"
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
        if indices.device.type == "cpu":  # on an accelerator the caller checked them on the host
            self.check_values(indices)
        handles = [
            router.register_forward_hook(self._hook(indices[:, layer]))
            for layer, router in enumerate(self.routers)
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def check_values(self, indices: torch.Tensor) -> None:
        """ReplayError unless every index is an expert id or -1 (a read of the values: done on the host,
        where it costs no device sync; `replay` checks CPU indices itself)."""
        if len(indices) and bool(((indices < -1) | (indices >= self.num_experts)).any()):
            raise ReplayError(
                f"replay indices must be expert ids in [0, {self.num_experts}) or -1, got values "
                f"{int(indices.min())}..{int(indices.max())}"
            )

    @staticmethod
    def _hook(given: torch.Tensor):
        def hook(module, _inputs, output):
            logits, scores, own = output
            if given.shape[0] != own.shape[0]:
                raise ReplayError(
                    f"replay indices cover {given.shape[0]} tokens, the forward has {own.shape[0]}"
                )
            keep_own = (given[:, :1] < 0).expand_as(own)
            chosen = torch.where(keep_own, own, given)
            weights = gate_function(module)(module, logits, chosen)
            return logits, weights.to(scores.dtype), chosen

        return hook
