"""The state of one native `generate` call besides the KV cache: each slot's decoding state (`Slots`) and
what the call records per fed position (`Record`: routed experts, router logits). Row i of every tensor
is cache row i; `select(rows)` keeps rows as the pool shrinks."""

from __future__ import annotations

import torch

from everyprompt.rollout.base import SamplingParams, UnsupportedModelError


class Record:
    """What a generate call records per fed position besides the sampled tokens, in buffers
    [slots, width, L_moe, ...] indexed like the cache: each MoE layer's top-k experts (`record_routes`,
    int16) and router logits (`record_router_logits`, float32)."""

    def __init__(self, routes: torch.Tensor | None, logits: torch.Tensor | None):
        self.routes, self.logits = routes, logits

    @classmethod
    def start(cls, engine, params: SamplingParams, slots: int, width: int) -> Record | None:
        if not (params.record_routes or params.record_router_logits):
            return None
        routers = [layer.router for layer in engine.layers if layer.router is not None]
        layers = len(routers)
        if not layers:
            wanted = "record_routes" if params.record_routes else "record_router_logits"
            raise UnsupportedModelError(f"{wanted} needs a mixture-of-experts model; this one has no router")
        experts = routers[0].shape[1]
        return cls(
            torch.zeros(slots, width, layers, engine.moe.routing.top_k, dtype=torch.int16)
            if params.record_routes
            else None,
            torch.zeros(slots, width, layers, experts) if params.record_router_logits else None,
        )

    def store(
        self, captured: list, rows: torch.Tensor, columns: torch.Tensor, step: int | None = None
    ) -> None:
        """Write one forward's (experts, logits) per MoE layer, each [B, T, .], into cache rows `rows` at
        positions `columns`: every position of a prefill ([T] columns, step None), or each row's one fed
        token of a decode step ([len(rows)] columns, step 0: rows index the forward's batch too)."""
        for field, buffer in enumerate((self.routes, self.logits)):
            if buffer is None:  # only what was asked for is stacked: a replay run records routes alone
                continue
            values = torch.stack([layer[field] for layer in captured], dim=2)  # [B, T, L_moe, k or E]
            if step is None:
                buffer[rows[:, None], columns[None, :]] = values.to(buffer.dtype)
            else:
                buffer[rows, columns] = values[rows, step].to(buffer.dtype)

    def select(self, rows: torch.Tensor) -> None:
        self.routes = None if self.routes is None else self.routes[rows]
        self.logits = None if self.logits is None else self.logits[rows]

    def take(self, slot: int, length: int) -> dict[str, torch.Tensor]:
        """A finished row's first `length` positions, as Completion fields."""
        out = {}
        if self.routes is not None:
            out["routed_experts"] = self.routes[slot, :length].clone()
        if self.logits is not None:
            out["router_logits"] = self.logits[slot, :length].clone()
        return out


class Slots:
    """Per-slot decoding state of one `generate` call (row i of every tensor is cache row i)."""

    def __init__(self, slots: int, max_new_tokens: int, vocab_size: int):
        self.request = torch.full((slots,), -1, dtype=torch.long)  # index into the call's requests; -1 free
        self.length = torch.zeros(slots, dtype=torch.long)  # tokens in the cache (prompt + fed)
        self.step = torch.zeros(slots, dtype=torch.long)  # tokens sampled so far
        self.limit = torch.zeros(slots, dtype=torch.long)  # this request's max new tokens
        self.seed = torch.zeros(slots, dtype=torch.long)
        self.logits = torch.zeros(slots, vocab_size)  # pending next-token logits
        self.tokens = torch.zeros(slots, max_new_tokens, dtype=torch.long)
        self.logprobs = torch.zeros(slots, max_new_tokens)
        self.entropies = torch.zeros(slots, max_new_tokens)

    def select(self, rows: torch.Tensor) -> None:
        for name, value in vars(self).items():
            setattr(self, name, value[rows])
