"""The rollout-engine contract shared by every engine implementation."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # log-probs are of softmax(logits / temperature)
    top_p: float = 1.0
    greedy: bool = False
    record_routes: bool = False  # return each token's top-k experts per MoE layer (router replay)
    # return each token's router logits per MoE layer (mismatch diagnosis: [T, L_moe, E] float32 per
    # completion, so keep it to small runs)
    record_router_logits: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.greedy and not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0 for sampling, got {self.temperature} (use greedy=True for greedy decoding)"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class GenerationRequest:
    request_id: int
    prompt_ids: list[int]
    seed: int = 0  # sampling noise depends only on (seed, position), never on the batch around it
    max_new_tokens: int | None = None  # this request's own cap (at most SamplingParams.max_new_tokens)


@dataclass
class Completion:
    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]  # sampled tokens, EOS included when finish_reason == "eos"
    logprobs: torch.Tensor  # [len(token_ids)] float32, log softmax(logits / T) of each sampled token
    finish_reason: Literal["eos", "length"]
    timing: dict[str, float] = field(default_factory=dict)
    # [len(prompt_ids) + len(token_ids) - 1, L_moe, k] int16 when SamplingParams.record_routes: the experts
    # each token fed through the model was routed to (the last sampled token is never fed)
    routed_experts: torch.Tensor | None = None
    # [len(prompt_ids) + len(token_ids) - 1, L_moe, E] float32 when SamplingParams.record_router_logits:
    # the router logits those same tokens were routed by, as the engine computed them
    router_logits: torch.Tensor | None = None
    entropies: torch.Tensor | None = None  # [len(token_ids)] entropy of softmax(logits / T); None if not kept


class RolloutEngine(Protocol):
    def generate(self, requests: Iterable[GenerationRequest], params: SamplingParams) -> Iterator[Completion]:
        """Yield each request's completion when it finishes (order not guaranteed)."""
        ...

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Replace the engine's weights with the trainer's (weight sync)."""
        ...
