"""The rollout-engine contract shared by every engine implementation, and the engine registry.

An engine registers itself with `@register_engine(name, model_types=...)`; `build_engine` is the one
place that turns a config's `rollout.engine` into an engine, and `check_engine` refuses a model the
engine cannot run when the model is loaded, naming the engines that could run it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

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


class UnsupportedModelError(ValueError):
    """The chosen rollout engine cannot run this model (or this request of it)."""


class RolloutEngine(Protocol):
    """What the rest of everyprompt may use of an engine: nothing else is read from one."""

    # the last finished generate call's figures: tokens, tokens_per_s, slot_occupancy, decode_step_ms,
    # decode_steps, wall_s (more are allowed); empty before the first call
    stats: dict[str, float]
    # whether SamplingParams.record_routes can be honoured (a mixture-of-experts model)
    can_record_routes: bool

    @classmethod
    def from_model(cls, model, tokenizer, batch_size: int, precision: str) -> RolloutEngine:
        """An engine over `model`'s current weights, with `batch_size` slots, at `precision`."""
        ...

    def generate(self, requests: Iterable[GenerationRequest], params: SamplingParams) -> Iterator[Completion]:
        """Yield each request's completion when it finishes (order not guaranteed)."""
        ...

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Replace the engine's weights with the trainer's (weight sync)."""
        ...


@dataclass(frozen=True)
class EngineSpec:
    cls: type
    model_types: tuple[str, ...]  # the `model_type`s (transformers config) the engine runs; () = any


_ENGINES: dict[str, EngineSpec] = {}


def register_engine(name: str, *, model_types: tuple[str, ...] = ()) -> Callable[[type], type]:
    """Class decorator: register a RolloutEngine implementation as `rollout.engine=name`."""

    def decorate(cls: type) -> type:
        if name in _ENGINES:
            raise ValueError(f"rollout engine {name!r} is already registered")
        _ENGINES[name] = EngineSpec(cls, tuple(model_types))
        return cls

    return decorate


def registered_engines() -> list[str]:
    return sorted(_ENGINES)


def _spec(name: str) -> EngineSpec:
    if name not in _ENGINES:
        raise KeyError(f"unknown rollout engine {name!r}; valid: {', '.join(registered_engines())}")
    return _ENGINES[name]


def engines_for(model_type: str | None) -> list[str]:
    """The registered engines that can run a model of this `model_type`."""
    return [
        n
        for n in registered_engines()
        if not _ENGINES[n].model_types or model_type in _ENGINES[n].model_types
    ]


def check_engine(name: str, model_config: Any) -> None:
    """UnsupportedModelError (one line: the model type, the engines that could run it) unless engine
    `name` runs models of `model_config`'s type."""
    spec = _spec(name)
    model_type = getattr(model_config, "model_type", None)
    if spec.model_types and model_type not in spec.model_types:
        others = engines_for(model_type)
        could = f"engines that can: {', '.join(others)}" if others else "no registered engine can"
        raise UnsupportedModelError(
            f"rollout.engine={name} cannot run model_type {model_type!r} (it runs "
            f"{', '.join(spec.model_types)}); {could}"
        )


def build_engine(config, model, tokenizer) -> RolloutEngine:
    """The engine a `RolloutConfig` names (`engine`, `batch_size`, `precision`), over `model`'s weights."""
    return make_engine(config.engine, model, tokenizer, config.batch_size, config.precision)


def make_engine(name: str, model, tokenizer, batch_size: int, precision: str = "fp32") -> RolloutEngine:
    """Registered engine `name` over `model`'s weights; UnsupportedModelError if it cannot run the model."""
    check_engine(name, model.config)
    return _spec(name).cls.from_model(model, tokenizer, batch_size=batch_size, precision=precision)
