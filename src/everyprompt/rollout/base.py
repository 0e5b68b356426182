"""The rollout-engine contract shared by every engine implementation: what a request, its sampling and
its completion are, the `RolloutEngine` protocol and what an engine may offer beyond it (`offers`), and
the figures an engine reports. The registry that names and makes engines: registry.py.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from everyprompt.errors import InputError

log = logging.getLogger(__name__)


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
    # strings that end a completion (finish_reason "stop") besides the model's end-of-sequence ids
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.greedy and not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0 for sampling, got {self.temperature} (use greedy=True for greedy decoding)"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty, got {list(self.stop)}")


class Episode(Protocol):
    """The other side of a multi-turn completion. A model turn ends where a completion would stop (one of
    the model's end-of-sequence ids, or a string of `SamplingParams.stop`); the engine then calls
    `turn_ended` with the completion's tokens so far, and either feeds the tokens it returns (the
    environment's observation, wrapped as the chat template wraps a message) into the same sequence and
    lets the model go on, or, given None, finishes the completion. Fed tokens are part of the completion
    but not the model's: `Completion.completion_mask` is False there, their log-probs and entropies 0.
    Once the completion finishes, `reward` is the episode's (None: never judged), `error` what ended it
    early, if anything, and `error_reason` why in a word (the exception's class, or `TIME_LIMIT`: the step's
    metrics count episodes by it); generation.py reads them. `turn_ended` runs in a thread of its own
    while the other sequences decode; past `time_limit` seconds (None: no limit) the engine ends the
    episode (`end_episode`)."""

    reward: float | None
    error: str | None
    error_reason: str | None
    time_limit: float | None

    def turn_ended(self, token_ids: list[int]) -> list[int] | None: ...


TIME_LIMIT = "time_limit"  # an episode's error_reason when its environment answered too late


def end_episode(episode: Episode, reason: str, error: str) -> None:
    """Record what ended `episode` early: `error`, and `reason` (a metric name: an exception's class or
    TIME_LIMIT). The only writer of both fields, engines and episodes alike."""
    episode.error, episode.error_reason = error, reason


def past_time_limit(episode: Episode, limit: float) -> None:
    """End `episode` early: its environment took longer than its time limit of `limit` seconds."""
    end_episode(episode, TIME_LIMIT, f"the environment took longer than its time limit of {limit:g} s")


@dataclass(frozen=True)
class GenerationRequest:
    request_id: int
    prompt_ids: list[int]
    seed: int = 0  # sampling noise depends only on (seed, position), never on the batch around it
    max_new_tokens: int | None = None  # this request's own cap (at most SamplingParams.max_new_tokens)
    # the length scheduler's guess of this completion's length (tokens): several rollout workers are dealt
    # requests by it (longest first, to the least-loaded worker); one engine may ignore it
    predicted_length: float | None = None
    # a multi-turn request's other side (an environment's episode, envs/episode.py): engines with
    # `episodes` among their `offers` call it at the end of each model turn and feed what it returns before the next
    episode: Episode | None = None


@dataclass
class Completion:
    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]  # sampled tokens, the stopping one included (EOS id, end of a stop string)
    logprobs: torch.Tensor  # [len(token_ids)] float32, log softmax(logits / T) of each sampled token
    # eos: one of the model's end-of-sequence ids; stop: a configured stop string; length: the token cap
    finish_reason: Literal["eos", "stop", "length"]
    timing: dict[str, float] = field(default_factory=dict)
    # [len(prompt_ids) + len(token_ids) - 1, L_moe, k] int16 when SamplingParams.record_routes: the experts
    # each token fed through the model was routed to (the last sampled token is never fed)
    routed_experts: torch.Tensor | None = None
    # [len(prompt_ids) + len(token_ids) - 1, L_moe, E] float32 when SamplingParams.record_router_logits:
    # the router logits those same tokens were routed by, as the engine computed them
    router_logits: torch.Tensor | None = None
    entropies: torch.Tensor | None = None  # [len(token_ids)] entropy of softmax(logits / T); None if not kept
    # [len(token_ids)] int32: the policy version that sampled each token; set by the rollout side (an engine
    # leaves it None), for completions that span a weight update (partial rollouts)
    versions: torch.Tensor | None = None
    # [len(token_ids)] bool for an episode's completion: True at the model's own tokens, False at the tokens
    # its environment fed (their log-probs and entropies are 0); None when every token is the model's
    completion_mask: torch.Tensor | None = None
    # the request's episode once the completion finished (an engine in another process returns its own copy,
    # the one the environment stepped): its reward is the completion's
    episode: Episode | None = None
    # a step-wise episode's turns (envs/stepwise.py): each the prompt the model was given and the tokens it
    # sampled; the batch trains one row per turn. None: the completion is one row
    turns: list[Completion] | None = None


# an engine's per-call figures that add up over the calls of a step (the native engine's CUDA graphs and the
# forwards that fed episodes' observations, rollout/native/extend.py), where
# an engine reports them: summed by the step's tally and by the Ray engine over its workers; and those whose
# largest stands for the step: flags that hold if they hold for any call (a capture that failed: its steps
# ran eagerly; a compile given up: the step decoded eager), and the largest difference a trusted graph's
# first replay showed
SUMMED_STATS = (
    "graph_replays",
    "graph_eager_steps",
    "graph_captures",
    "graph_capture_s",
    "extends",
    "extend_s",
)
MAX_STATS = ("graph_failed", "graph_replay_eps", "compile_failed")


def summed_stats(calls: list[dict[str, float]]) -> dict[str, float]:
    """The `SUMMED_STATS` the calls report, each added up over them, and the `MAX_STATS`, the largest."""
    return {
        name: float((max if name in MAX_STATS else sum)(c.get(name, 0.0) for c in calls))
        for name in (*SUMMED_STATS, *MAX_STATS)
        if any(name in c for c in calls)
    }


def call_stats(clock: dict[str, float], wall: float, slots: int) -> dict[str, float]:
    """An engine's `stats` for one generate call from its running counts (`tokens`, `busy`: the sum over
    decode steps of the busy slot fraction, `decode_s`, `decode_steps`, `prefill_s`, `admissions`, and
    optional ones such as `shrinks`) and its wall time."""
    steps = max(clock["decode_steps"], 1)
    stats = {
        "tokens": float(clock["tokens"]),
        "tokens_per_s": clock["tokens"] / wall if wall > 0 else 0.0,
        "slot_occupancy": clock["busy"] / steps,
        "decode_step_ms": 1000 * clock["decode_s"] / steps,
        "decode_steps": float(clock["decode_steps"]),
        "prefill_s": clock["prefill_s"],
        "wall_s": wall,
        "slots": float(slots),
        "admissions": float(clock["admissions"]),
    }
    if "shrinks" in clock:
        stats["pool_shrinks"] = float(clock["shrinks"])
    return stats


class UnsupportedModelError(InputError):
    """The chosen rollout engine cannot run this model (or this request of it)."""


class RolloutEngine(Protocol):
    """What the rest of everyprompt may use of an engine: nothing else is read from one."""

    # the last finished generate call's figures: tokens, tokens_per_s, slot_occupancy, decode_step_ms,
    # decode_steps, wall_s (more are allowed); empty before the first call
    stats: dict[str, float]
    # whether SamplingParams.record_routes can be honoured (a mixture-of-experts model)
    can_record_routes: bool
    # what it offers beyond these, of `ENGINE_OFFERS` (read through `offers`; an engine that declares none
    # offers none): `device` (it places itself), `compile` (its decode step through torch.compile),
    # `cuda_graphs` (with `graph_buckets`: its decode step captured), `episodes` (multi-turn requests),
    # `decode_state` (`decode_state()` and `load_decode_state(state)`: how it has been decoding, such as
    # a compile switch made mid-run, kept in a checkpoint so that a resumed run decodes the same way),
    # `weight_dtypes` (`weight_dtypes()`: below), `live` (`generate` over a `LiveRequests` source: requests
    # that join a call while it runs, rollout/native/queue.py)
    offers: frozenset[str]

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

    def sleep(self) -> None:
        """Free what the engine holds between calls (weights, KV cache) until the next `load_weights`.
        A synchronous run's engine is idle while the learner trains, and the weight sync after the
        update hands it new weights anyway, so its memory is the learner's for that time (vLLM's sleep
        mode; `rollout.sleep_while_training`). An engine with nothing worth freeing does nothing."""
        ...

    # only where `offers(engine, "decode_state")`:
    def decode_state(self) -> dict:
        """How the engine has been decoding (a compile switch made mid-run), for a checkpoint."""
        ...

    def load_decode_state(self, state: dict) -> None:
        """Decode from now on as the engine that wrote `state` (`decode_state()`) would have."""
        ...

    # only where `offers(engine, "weight_dtypes")`:
    def weight_dtypes(self) -> dict[str, torch.dtype]:
        """The dtype the engine holds each weight in, by the trainer's names, where holding it is a plain
        cast of the weight as `load_weights` is given it (a weight whose held value is computed from the
        one given, such as fp8's quantised projections, is not listed): a weight cast to its listed dtype
        before it is sent loads the same bits, so a sender over a wire sends the narrower
        (`cluster.sync_dtype`)."""
        ...


# what an engine may offer beyond the protocol's required members, each named by the setting or feature
ENGINE_OFFERS = ("device", "compile", "cuda_graphs", "episodes", "decode_state", "weight_dtypes", "live")


def offers(engine, what: str) -> bool:
    """Whether `engine` (an engine or its class) offers `what`, one of `ENGINE_OFFERS`."""
    if what not in ENGINE_OFFERS:
        raise ValueError(f"an engine offers one of {', '.join(ENGINE_OFFERS)}; {what!r} is none of them")
    return what in getattr(engine, "offers", frozenset())


def saved_decode_state(engine) -> dict | None:
    """What a checkpoint keeps of how `engine` has been decoding (its `decode_state`, named by its class);
    None where it offers none."""
    if not offers(engine, "decode_state"):
        return None
    return {"engine": type(engine).__name__, "state": engine.decode_state()}


def restore_decode_state(engine, saved: dict | None) -> None:
    """`engine` decodes on as the engine that wrote `saved` (`saved_decode_state`) did, where both are of
    one class; a run resumed on another (Ray workers' checkpoint, one local engine) starts afresh."""
    if saved is None or not offers(engine, "decode_state"):
        return
    if saved.get("engine") != type(engine).__name__:
        log.info(
            "resuming on a %s engine from a %s engine's checkpoint: its decode state (the compile switch) "
            "starts afresh",
            type(engine).__name__,
            saved.get("engine"),
        )
        return
    engine.load_decode_state(saved["state"])
