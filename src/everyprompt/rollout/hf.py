"""The `hf` rollout engine: any transformers causal LM, decoded through the model's own forward.

It runs the policy's architecture exactly as the trainer does (a copy of the same module tree), so it
serves every family transformers implements; the native engine is the faster path where one exists.
transformers' own `generate` and continuous-batching manager sample with their own random streams and
return neither entropies nor per-(seed, position) reproducible samples, so this engine keeps its own
decode loop around the model's forward and samples with `rollout.sampling` like the native engine: a
request's tokens are the same whichever batch it is decoded in.

Continuous batching over transformers' `DynamicCache`: up to `batch_size` sequences decode together,
left-padded to a common cache length (the attention mask hides the padding, position ids count only real
tokens). The model, its cache and the call's masks live on the engine's `device`; a decode step reads
back one tensor (the sampled tokens with their log-probs and entropies), and recorded routes stay on the
device until their sequence finishes. A finished sequence's row is dropped; requests waiting in the queue are prefilled together and
their cache rows joined to the running ones (the shorter side padded on the left), so the pool refills
before the next step. A model whose cache keeps anything but plain growing layers (sliding windows, linear
attention) is refilled only when its batch has drained.
"""

from __future__ import annotations

import inspect
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from everyprompt.choices import HF_ENGINE
from everyprompt.models.attention import cuda_attention_without_cudnn
from everyprompt.models.io import load_one_by_one
from everyprompt.models.lora import plain_copy
from everyprompt.models.replay import find_routers
from everyprompt.rollout.base import (
    Completion,
    GenerationRequest,
    SamplingParams,
    UnsupportedModelError,
    call_stats,
)
from everyprompt.rollout.registry import register_engine
from everyprompt.rollout.sampling import sampler
from everyprompt.rollout.stops import StopStrings, stop_token_ids

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class _Row:
    """One running sequence: its request, what it has sampled, what its fed tokens were routed to."""

    index: int  # into the call's requests
    limit: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    routes: list[torch.Tensor] = field(default_factory=list)  # [n, L_moe, k] per forward
    router_logits: list[torch.Tensor] = field(default_factory=list)  # [n, L_moe, E] per forward


class _Captured:
    """Forward hooks on a model's routers that keep each forward's (indices, logits) per MoE layer."""

    def __init__(self, routers, params: SamplingParams):
        self.indices: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        self.handles = []
        if params.record_routes or params.record_router_logits:
            self.handles = [router.register_forward_hook(self._hook) for router in routers]
        self.routes, self.keep_logits = params.record_routes, params.record_router_logits

    def _hook(self, _module, _inputs, output) -> None:
        if self.routes:
            self.indices.append(output[2].to(torch.int16))
        if self.keep_logits:
            self.logits.append(output[0].float())

    def take(self, batch: int, length: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The last forward's [batch, length, L_moe, .] indices and logits (None where not recorded)."""
        out = []
        for kept in (self.indices, self.logits):
            out.append(torch.stack(kept, 1).view(batch, length, len(kept), -1) if kept else None)
            kept.clear()
        return out[0], out[1]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


@register_engine(HF_ENGINE)
class HFEngine:
    """RolloutEngine over a transformers causal LM (any architecture). Build it with :meth:`from_model`."""

    PRECISIONS = tuple(DTYPES)
    # the model copy, its cache and the call's tensors on that device; the dtype each weight is held in
    offers = frozenset({"device", "weight_dtypes"})

    def __init__(
        self,
        model,
        eos_token_ids,
        pad_token_id: int,
        batch_size: int = 64,
        precision: str = "fp32",
        tokenizer=None,
        device: torch.device | str = "cpu",
    ):
        if precision not in DTYPES:
            raise UnsupportedModelError(
                f"rollout.engine=hf runs at rollout.precision fp32 or bf16, got {precision!r} "
                "(fp8 rollouts are the native engine's)"
            )
        self.precision, self.dtype = precision, DTYPES[precision]
        self.device = torch.device(device)
        self.model = model.to(self.device, self.dtype).eval().requires_grad_(False)
        cuda_attention_without_cudnn(self.model)  # on CUDA: each step's new width (devices/sdpa.py)
        self.stop_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.pad_token_id, self.batch_size = pad_token_id, batch_size
        self.tokenizer = tokenizer
        self.routers = find_routers(self.model)
        self.sampler = sampler(self.model.config.vocab_size, self.device)  # the vocabulary's hashes made once
        # transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name warns)
        forward = inspect.signature(self.model.forward).parameters
        self.cache_key = "cache" if "cache" in forward else "past_key_values"
        self.stats: dict[str, float] = {}

    @property
    def can_record_routes(self) -> bool:
        return bool(self.routers)

    @classmethod
    def from_model(
        cls,
        model,
        tokenizer,
        batch_size: int = 64,
        precision: str = "fp32",
        device: torch.device | str = "cpu",
    ) -> HFEngine:
        """An engine over a copy of `model` (the trainer's module is never touched by decoding)."""
        return cls(
            plain_copy(model),  # a LoRA policy's copy has its adapters merged in
            stop_token_ids(model, tokenizer),
            tokenizer.pad_token_id,
            batch_size,
            precision,
            tokenizer,
            device,
        )

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy `state_dict` into the model's tensors one weight at a time (a LoRA policy's merged
        weights are made as they are read, a sync's buckets fetched as they are reached: a few in memory
        at a time), after checking that its names are the model's."""
        load_one_by_one(self.model, state_dict)

    def weight_dtypes(self) -> dict[str, torch.dtype]:
        """The dtype of each of the model's floating tensors: `load_weights` copies into them, a cast."""
        return {name: t.dtype for name, t in self.model.state_dict().items() if t.is_floating_point()}

    def sleep(self) -> None:
        """Nothing: the copy of the module is the engine (remaking it at every weight sync would cost
        what freeing it saves); its KV cache lives only within a generate call."""

    # ---------------------------------------------------------------- decoding
    def generate(self, requests: Iterable[GenerationRequest], params: SamplingParams) -> Iterator[Completion]:
        """Continuous batching (see the module doc); each completion is yielded when it finishes and
        `self.stats` holds the call's throughput figures once the iterator is exhausted."""
        requests = list(requests)
        for request in requests:
            if not request.prompt_ids:
                raise ValueError(f"generation request {request.request_id} has an empty prompt")
        if any(request.episode is not None for request in requests):
            raise UnsupportedModelError(
                "the hf engine runs single-turn requests; episodes need rollout.engine=native"
            )
        if (params.record_routes or params.record_router_logits) and not self.routers:
            wanted = "record_routes" if params.record_routes else "record_router_logits"
            raise UnsupportedModelError(f"{wanted} needs a mixture-of-experts model; this one has no router")
        self.stats = {}
        if not requests:
            return
        captured = _Captured(self.routers, params)
        try:
            yield from self._generate(requests, params, captured)
        finally:
            captured.close()

    def _generate(self, requests: list[GenerationRequest], params: SamplingParams, captured: _Captured):
        began = time.perf_counter()
        stops = StopStrings(self.tokenizer, params.stop)
        queue = deque(range(len(requests)))
        batch = _Batch(self.device)
        clock = dict(prefill_s=0.0, decode_s=0.0, decode_steps=0, busy=0.0, tokens=0, admissions=0)
        pool = min(self.batch_size, len(requests))
        while queue or batch.rows:
            free = pool - len(batch.rows)
            if queue and free and (not batch.rows or batch.mergeable):
                tick = time.perf_counter()
                admitted = [queue.popleft() for _ in range(min(free, len(queue)))]
                self._admit(batch, requests, admitted, params, captured)
                clock["prefill_s"] += time.perf_counter() - tick
                clock["admissions"] += 1
            seeds = [requests[row.index].seed for row in batch.rows]
            steps = [len(row.tokens) for row in batch.rows]
            seeds, steps = torch.tensor([seeds, steps], dtype=torch.long).to(self.device, non_blocking=True)
            sampled, logprobs, entropies = self.sampler(
                batch.logits, seeds, steps, params.temperature, params.top_p, params.greedy
            )
            clock["tokens"] += len(batch.rows)
            keep = []
            # one read back a step: the tokens (exact in float64 below 2^53), log-probs and entropies
            read = torch.stack([sampled.double(), logprobs.double(), entropies.double()]).tolist()
            for i, (row, token, logprob, entropy) in enumerate(zip(batch.rows, *read)):
                token = int(token)
                row.tokens.append(token)
                row.logprobs.append(logprob)
                row.entropies.append(entropy)
                if token in self.stop_token_ids:
                    reason = "eos"
                elif stops.hit(row.tokens):
                    reason = "stop"
                elif len(row.tokens) >= row.limit:
                    reason = "length"
                else:
                    keep.append(i)
                    continue
                yield self._completion(requests[row.index], row, reason, began)
            if len(keep) < len(batch.rows):
                batch.select(keep)
            if not batch.rows:
                continue
            tick = time.perf_counter()
            fed = sampled[torch.tensor(keep, device=self.device)] if len(keep) < len(sampled) else sampled
            self._decode(batch, fed, captured)
            clock["decode_s"] += time.perf_counter() - tick
            clock["decode_steps"] += 1
            clock["busy"] += len(batch.rows) / pool
        self.stats = call_stats(clock, time.perf_counter() - began, pool)

    @torch.inference_mode()
    def _admit(self, batch: _Batch, requests, admitted: list[int], params: SamplingParams, captured) -> None:
        """Prefill the admitted prompts (left-padded) and join their cache rows to the batch's."""
        prompts = [requests[i].prompt_ids for i in admitted]
        width = max(map(len, prompts))
        tokens = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, prompt in enumerate(prompts):
            tokens[r, width - len(prompt) :] = torch.tensor(prompt)
            mask[r, width - len(prompt) :] = 1
        tokens, mask = tokens.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_key: cache},
        )
        routes, logits = captured.take(len(prompts), width)
        rows = []
        for r, i in enumerate(admitted):
            limit = min(params.max_new_tokens, requests[i].max_new_tokens or params.max_new_tokens)
            row = _Row(i, limit)
            n = len(prompts[r])
            if routes is not None:
                row.routes.append(routes[r, width - n :])
            if logits is not None:
                row.router_logits.append(logits[r, width - n :])
            rows.append(row)
        batch.join(rows, getattr(out, self.cache_key), mask, positions[:, -1] + 1, out.logits[:, -1].float())

    @torch.inference_mode()
    def _decode(self, batch: _Batch, fed: torch.Tensor, captured) -> None:
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((len(fed), 1))], dim=1)
        out = self.model(
            input_ids=fed[:, None],
            attention_mask=batch.mask,
            position_ids=batch.next_position[:, None],
            use_cache=True,
            **{self.cache_key: batch.cache},
        )
        batch.cache = getattr(out, self.cache_key)
        batch.next_position = batch.next_position + 1
        batch.logits = out.logits[:, -1].float()
        routes, logits = captured.take(len(fed), 1)
        for r, row in enumerate(batch.rows):
            if routes is not None:
                row.routes.append(routes[r])
            if logits is not None:
                row.router_logits.append(logits[r])

    def _completion(self, request: GenerationRequest, row: _Row, reason: str, began: float) -> Completion:
        extra = {}
        if row.routes:
            extra["routed_experts"] = torch.cat(row.routes).cpu()
        if row.router_logits:
            extra["router_logits"] = torch.cat(row.router_logits).cpu()
        return Completion(
            request_id=request.request_id,
            prompt_ids=list(request.prompt_ids),
            token_ids=list(row.tokens),
            logprobs=torch.tensor(row.logprobs, dtype=torch.float32),
            entropies=torch.tensor(row.entropies, dtype=torch.float32),
            finish_reason=reason,
            timing={"finished_s": time.perf_counter() - began},
            **extra,
        )


class _Batch:
    """The running rows of one generate call and their shared cache: row i of `cache`, `mask`,
    `next_position` and `logits` is `rows[i]`."""

    def __init__(self, device: torch.device):
        self.rows: list[_Row] = []
        self.cache: DynamicCache | None = None
        # [B, S] 1 where the cache holds a real token
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=device)
        # [B] the position id of the next fed token
        self.next_position = torch.zeros(0, dtype=torch.long, device=device)
        self.logits = torch.zeros(0, device=device)  # [B, V] pending next-token logits

    @property
    def mergeable(self) -> bool:
        """Whether new rows can join: every cache layer is a plain growing one (no sliding window)."""
        return self.cache is not None and all(type(layer) is DynamicLayer for layer in self.cache.layers)

    def join(self, rows, cache, mask, next_position, logits) -> None:
        if not self.rows:
            self.rows, self.cache, self.mask, self.next_position, self.logits = (
                rows,
                cache,
                mask,
                next_position,
                logits,
            )
            return
        width = max(self.mask.shape[1], mask.shape[1])
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([_pad_left(mine.keys, width), _pad_left(theirs.keys, width)])
            mine.values = torch.cat([_pad_left(mine.values, width), _pad_left(theirs.values, width)])
        self.mask = torch.cat([_pad_left(self.mask, width, dim=1), _pad_left(mask, width, dim=1)])
        self.rows = self.rows + rows
        self.next_position = torch.cat([self.next_position, next_position])
        self.logits = torch.cat([self.logits, logits])

    def select(self, keep: list[int]) -> None:
        """Keep rows `keep`, then drop cache columns no remaining row uses (all padding)."""
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache = None
            return
        index = torch.tensor(keep).to(self.mask.device, non_blocking=True)
        self.cache.batch_select_indices(index)
        self.mask, self.next_position, self.logits = (
            self.mask[index],
            self.next_position[index],
            self.logits[index],
        )
        unused = int((self.mask.sum(0) == 0).long().cumprod(0).sum())
        if unused and self.mergeable:
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[..., unused:, :], layer.values[..., unused:, :]
            self.mask = self.mask[:, unused:]


def _pad_left(x: torch.Tensor, width: int, dim: int = -2) -> torch.Tensor:
    """`x` with zeros prepended along `dim` up to `width` (dim -2: a cache's sequence axis)."""
    missing = width - x.shape[dim]
    if missing <= 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - (dim % x.dim())) + [missing, 0]
    return F.pad(x, pad)
