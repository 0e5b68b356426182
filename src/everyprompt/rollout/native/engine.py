"""The native rollout engine: continuous batching over a preallocated KV cache, on the policy's weights.

It is a second implementation of the model's forward pass, written for decoding rather than gradients
(as vLLM is beside Megatron in production): no autograd, no module tree, one preallocated cache.
Families: `families.FAMILIES` (Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3;
attention variants in attention.py, the MoE layer in moe.py); a config
setting it does not compute is refused when the model loads (`check_config`). The trainer's HF forward is
the reference it is tested against (log-probs equal within 1e-4 in fp32).

Layout: the cache has `batch_size` rows (slots). A request is admitted into a free row, its prompt
prefilled at cache positions [0, len) (prompts admitted together are right-padded; causal attention keeps
real tokens from seeing the padding), and its t-th generated token is fed at position len + t. A decode
step runs every row at once, each at its own position, attending to its positions <= that one. When a
sequence finishes, its row is refilled from the queue before the next step; once the queue is empty,
the running rows move to the front and the pool shrinks to them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator

import torch

from everyprompt.choices import NATIVE_ENGINE
from everyprompt.models.lora import merged_state_dict
from everyprompt.rollout.base import (
    Completion,
    GenerationRequest,
    SamplingParams,
    UnsupportedModelError,
    call_stats,
    register_engine,
)
from everyprompt.rollout.native.attention import ATTENTIONS, rms_norm
from everyprompt.rollout.native.compiled import DecodeCompiler
from everyprompt.rollout.native.families import FAMILIES, unsupported_settings
from everyprompt.rollout.native.moe import MixtureOfExperts, swiglu
from everyprompt.rollout.native.state import Record, Slots
from everyprompt.rollout.native.weights import Layer, StateDict, read_layer
from everyprompt.rollout.sampling import sample_tokens
from everyprompt.rollout.stops import StopStrings, stop_token_ids

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float32}


@register_engine(NATIVE_ENGINE, model_types=tuple(FAMILIES), rank=0)
class NativeEngine:
    """RolloutEngine over a state dict of one of `FAMILIES`. Build it with :meth:`from_model`."""

    PRECISIONS = tuple(PRECISIONS)
    compiles = True  # `compile`: the decode step through torch.compile (compiled.py)

    def __init__(
        self,
        config,
        state_dict: dict[str, torch.Tensor],
        eos_token_id: int | Iterable[int],
        pad_token_id: int,
        batch_size: int = 256,
        dtype: torch.dtype = torch.float32,
        precision: str | None = None,
        tokenizer=None,
        compile: str = "off",
    ):
        """`precision` (fp32 | bf16 | fp8) overrides `dtype`; fp8 keeps the attention and expert / MLP
        projections in float8_e4m3fn (per-output-channel scales, re-quantised by every `load_weights`),
        and embeddings, norms, routers and the LM head in float32. `compile` (off | on | auto): the
        decode step eager or through torch.compile (compiled.py)."""
        if precision is not None:
            if precision not in PRECISIONS:
                raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
            dtype = PRECISIONS[precision]
        self.precision = precision or ("bf16" if dtype == torch.bfloat16 else "fp32")
        self.check_config(config)
        self.config, self.family = config, FAMILIES[config.model_type]
        stops = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.stop_ids = torch.tensor(sorted(stops), dtype=torch.long)
        self.pad_token_id, self.tokenizer = pad_token_id, tokenizer
        self.batch_size, self.dtype = batch_size, dtype
        self.eps = config.rms_norm_eps
        self.attention = ATTENTIONS[self.family.attention](config, self.family, dtype)
        self.moe = MixtureOfExperts(config, self.family)
        self._cache_storage: list[tuple[torch.Tensor, ...]] = []
        self.compiler = DecodeCompiler(compile)
        self._open_calls = 0  # generate() iterators not yet finished (the shared cache serves one)
        self.stats: dict[str, float] = {}  # the last generate call's throughput figures
        self.load_weights(state_dict)

    @classmethod
    def check_config(cls, config) -> None:
        """UnsupportedModelError naming every setting of `config` this engine does not compute."""
        if getattr(config, "model_type", None) not in FAMILIES:
            raise UnsupportedModelError(
                f"the native engine runs model_type {', '.join(FAMILIES)}, not {config.model_type!r}"
            )
        found = unsupported_settings(config)
        if found:
            raise UnsupportedModelError(
                f"the native engine does not implement {'; '.join(found)} (model_type {config.model_type})"
            )

    @property
    def can_record_routes(self) -> bool:
        """A mixture-of-experts model: its layers have routers whose choices can be recorded."""
        return any(layer.router is not None for layer in self.layers)

    @classmethod
    def from_model(
        cls, model, tokenizer, batch_size: int = 256, precision: str = "fp32", compile: str = "off"
    ) -> NativeEngine:
        return cls(
            model.config,
            merged_state_dict(model),  # a LoRA policy's adapters folded in: the engine knows none
            stop_token_ids(model, tokenizer),
            tokenizer.pad_token_id,
            batch_size,
            precision=precision,
            tokenizer=tokenizer,
            compile=compile,
        )

    # ---------------------------------------------------------------- weights
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        weights = StateDict(state_dict, self.dtype, fp8=self.precision == "fp8")
        self.embed = weights.plain("model.embed_tokens.weight")
        self.final_norm = weights.plain("model.norm.weight")
        head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
        self.lm_head = weights.operand(head)
        self.layers = [
            read_layer(weights, self.family, self.attention, i) for i in range(self.config.num_hidden_layers)
        ]

    # ---------------------------------------------------------------- forward
    def _decode_bias(self, positions: torch.Tensor, width: int) -> torch.Tensor:
        """The decode step's attention mask as an additive bias [B * mask_heads, group, width] (the
        attention's `mask_layout`): row b sees its slots <= positions[b]. Built once per step for all
        layers."""
        visible = torch.arange(width)[None, :] <= positions[:, None]
        bias = torch.zeros(visible.shape, dtype=self.dtype).masked_fill_(~visible, float("-inf"))
        heads, group = self.attention.mask_layout
        return bias[:, None, None].expand(-1, heads, group, -1).reshape(-1, group, width)

    def _mlp(self, layer: Layer, x: torch.Tensor, routes: list | None = None) -> torch.Tensor:
        if layer.router is not None:
            return self.moe(layer, x, routes)
        return swiglu(layer.mlp, x)

    def _forward(
        self, layers, tokens, positions, caches, rows, bias, last, routes: list | None = None
    ) -> torch.Tensor:
        """Logits [B, V] at position `last` [B] of each row, the last position if None (attention.py: prefill
        vs decode), through `layers` (the call's dequantised `self.layers`).

        With `routes` (a list), appends each MoE layer's (expert indices [B, T, k], router logits [B, T, E]).
        """
        x = self.embed[tokens]
        rope = self.attention.rotary(positions)
        for layer, cache in zip(layers, caches):
            normed = rms_norm(x, layer.input_norm, self.eps)
            x = x + self.attention(layer.attention, normed, rope, cache, rows, positions[:, -1], bias)
            x = x + self._mlp(layer, rms_norm(x, layer.post_norm, self.eps), routes)
        x = x[:, -1] if last is None else x[torch.arange(x.shape[0]), last]
        return (rms_norm(x, self.final_norm, self.eps) @ self.lm_head).float()

    def _cache(
        self, slots: int, width: int, shared: bool = True, exact: bool = False
    ) -> list[tuple[torch.Tensor, ...]]:
        """Per-layer caches, one tensor [slots, heads, width, dim] per entry of the attention's
        `cache_layout` (keys and values; latent attention: one latent vector): views of storage kept
        between calls and grown as calls need (`shared=False`: storage of its own, for a call made while
        another call's iterator is still open; `exact`: storage exactly `width` wide, so the views are
        contiguous)."""

        def allocate(rows: int, columns: int) -> list[tuple[torch.Tensor, ...]]:
            layout = self.attention.cache_layout
            return [
                tuple(torch.zeros(rows, heads, columns, dim, dtype=self.dtype) for heads, dim in layout)
                for _ in self.layers
            ]

        if not shared:
            return allocate(slots, width)
        have = self._cache_storage[0][0] if self._cache_storage else None
        if (
            have is None
            or have.dtype != self.dtype
            or have.shape[0] < slots
            or have.shape[2] < width
            or (exact and have.shape[2] != width)
        ):
            rows, columns = (
                (slots, width)
                if have is None or exact
                else (max(slots, have.shape[0]), max(width, have.shape[2]))
            )
            self._cache_storage = allocate(rows, columns)
        return [tuple(t[:slots, :, :width] for t in entry) for entry in self._cache_storage]

    # ---------------------------------------------------------------- decoding
    def generate(self, requests: Iterable[GenerationRequest], params: SamplingParams) -> Iterator[Completion]:
        """Continuous batching: up to `batch_size` sequences decode together in cache slots; a finished
        sequence's slot is refilled from the queue (in the order given) before the next decode step.
        Each completion is yielded the moment it finishes. `self.stats` holds the call's throughput
        figures once the iterator is exhausted. A call made while another call's iterator is still open
        gets a cache of its own, so interleaved iterators do not corrupt each other."""
        requests = list(requests)
        for request in requests:
            if not request.prompt_ids:
                raise ValueError(f"generation request {request.request_id} has an empty prompt")
        self.stats = {}
        if not requests:
            return
        self._open_calls += 1
        try:
            yield from self._generate(requests, params, shared=self._open_calls == 1)
        finally:
            self._open_calls -= 1

    @torch.inference_mode()
    def _generate(self, requests: list[GenerationRequest], params: SamplingParams, shared: bool):
        began = time.perf_counter()
        pool = min(self.batch_size, len(requests))
        width = max(len(r.prompt_ids) for r in requests) + params.max_new_tokens
        state = Slots(pool, params.max_new_tokens, self.config.vocab_size)
        stops = StopStrings(self.tokenizer, params.stop)
        forward, sample, compiled = self._step_functions()
        # a compiled step reads the call's whole cache width (masked), so its cache is contiguous and of
        # one layout for the whole call; an eager one reads the slots up to the furthest position
        caches = self._cache(pool, width, shared, exact=compiled)
        layers = [layer.dequantized() for layer in self.layers]
        record = Record.start(self, params, pool, width)
        queue = deque(range(len(requests)))
        clock = {
            "prefill_s": 0.0,
            "decode_s": 0.0,
            "decode_steps": 0,
            "busy": 0,
            "tokens": 0,
            "shrinks": 0,
            "admissions": 0,
            "sample_s": 0.0,
            "sample_steps": 0,
        }
        while queue or bool((state.request >= 0).any()):
            free = (state.request < 0).nonzero().flatten()
            if queue and len(free):
                admitted = [queue.popleft() for _ in range(min(len(free), len(queue)))]
                tick = time.perf_counter()
                self._prefill(
                    layers, requests, admitted, free[: len(admitted)], state, caches, params, record
                )
                clock["prefill_s"] += time.perf_counter() - tick
                clock["admissions"] += 1
            active = (state.request >= 0).nonzero().flatten()
            tick = time.perf_counter()
            sampled, logprobs, entropies = sample(
                state.logits[active],
                state.seed[active],
                state.step[active],
                params.temperature,
                params.top_p,
                params.greedy,
            )
            state.tokens[active, state.step[active]] = sampled
            state.logprobs[active, state.step[active]] = logprobs
            state.entropies[active, state.step[active]] = entropies
            state.step[active] += 1
            sampling = time.perf_counter() - tick
            clock["sample_s"] += sampling
            clock["sample_steps"] += 1
            clock["tokens"] += len(active)
            finished = torch.isin(sampled, self.stop_ids) | (state.step[active] >= state.limit[active])
            if stops.strings:
                steps = state.step[active].tolist()
                finished |= torch.tensor(
                    [
                        stops.hit(state.tokens[slot, max(0, step - stops.tail) : step].tolist())
                        for slot, step in zip(active.tolist(), steps)
                    ]
                )
            for slot in active[finished].tolist():
                yield self._completion(requests[int(state.request[slot])], state, slot, record, began, stops)
                state.request[slot] = -1
            running = active[~finished]
            if not len(running):
                continue
            if not queue and len(running) < len(state.request):
                # nothing left to admit: move the running rows to the front and drop the idle ones (on
                # CPU a decode step's cost follows its rows; copying the cache is cheaper than idle rows)
                caches = self._compact(running, state, caches, record)
                running = torch.arange(len(running))
                clock["shrinks"] += 1
            fed = sampled[~finished]
            tick = time.perf_counter()
            tokens = torch.full((len(state.request),), self.pad_token_id, dtype=torch.long)
            tokens[running] = fed
            positions = state.length  # idle rows write at their own (free) row's stale length
            seen = caches
            if not compiled:
                width = int(positions.max()) + 1  # the cache slots this step reads
                seen = [tuple(entry[:, :, :width] for entry in layer) for layer in caches]
            logits, routes = forward(layers, tokens, positions, seen, record is not None)
            state.logits[running] = logits[running]
            if record is not None:
                record.store(routes, running, state.length[running], step=0)
            state.length[running] += 1
            stepped = time.perf_counter() - tick
            clock["decode_s"] += stepped
            clock["decode_steps"] += 1
            clock["busy"] += len(running) / pool
            if not compiled:
                self.compiler.add_eager(sampling + stepped)
        self.stats = call_stats(clock, time.perf_counter() - began, pool)
        self.stats["sample_ms"] = 1000 * clock["sample_s"] / max(clock["sample_steps"], 1)
        self.stats.update(self.compiler.stats())

    def _step_functions(self):
        """The decode forward and the sampler of a generate call, and whether they are compiled
        (`compile`: on, or auto once eager decoding has cost enough)."""
        if not self.compiler.active:
            return self._decode, sample_tokens, False
        if not self.compiler.bound:
            self.compiler.bind(self._decode, sample_tokens)
        return self.compiler.forward, self.compiler.sample, True

    def _decode(self, layers, tokens, positions, caches, record: bool):
        """One decode step of every cache row: the logits [B, V] of each row's next token after feeding
        `tokens` [B] at `positions` [B] (cache views up to the furthest position + 1 when eager, the call's
        whole width when compiled) and, when `record`, each MoE layer's (experts, router logits)."""
        bias = self._decode_bias(positions, caches[0][0].shape[2])
        routes: list | None = [] if record else None
        rows = torch.arange(tokens.shape[0])
        logits = self._forward(layers, tokens[:, None], positions[:, None], caches, rows, bias, None, routes)
        return logits, routes

    def _prefill(self, layers, requests, admitted, slots, state, caches, params, record):
        """Run the admitted prompts (right-padded) into cache rows `slots`; their next-token logits become
        the rows' pending logits (and their routes go into `record`, when the call records)."""
        prompts = [requests[i].prompt_ids for i in admitted]
        lengths = torch.tensor([len(p) for p in prompts])
        tokens = torch.full((len(prompts), int(lengths.max())), self.pad_token_id, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = torch.tensor(prompt)
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        routes: list | None = [] if record is not None else None
        logits = self._forward(layers, tokens, positions, caches, slots, None, lengths - 1, routes)
        if record is not None:
            record.store(routes, slots, torch.arange(tokens.shape[1]))
        state.request[slots] = torch.tensor(admitted)
        state.length[slots] = lengths
        state.step[slots] = 0
        state.logits[slots] = logits
        state.seed[slots] = torch.tensor([requests[i].seed for i in admitted], dtype=torch.long)
        state.limit[slots] = torch.tensor(
            [
                min(params.max_new_tokens, requests[i].max_new_tokens or params.max_new_tokens)
                for i in admitted
            ]
        )

    def _compact(self, running, state, caches, record):
        """Move the running rows to cache rows [0, n) and shrink the pool to n rows."""
        n = len(running)
        compacted = []
        for entry in caches:
            for tensor in entry:
                tensor[:n] = tensor[running]
            compacted.append(tuple(tensor[:n] for tensor in entry))
        state.select(running)
        if record is not None:
            record.select(running)
        return compacted

    def _completion(self, request, state, slot: int, record, began: float, stops: StopStrings) -> Completion:
        length = int(state.step[slot])
        token_ids = state.tokens[slot, :length].tolist()
        if token_ids[-1] in self.stop_ids:
            reason = "eos"
        elif stops.hit(token_ids):
            reason = "stop"
        else:
            reason = "length"
        return Completion(
            request_id=request.request_id,
            prompt_ids=list(request.prompt_ids),
            token_ids=token_ids,
            logprobs=state.logprobs[slot, :length].clone(),
            entropies=state.entropies[slot, :length].clone(),
            # the last sampled token was never fed, so it has no route
            **({} if record is None else record.take(slot, len(request.prompt_ids) + length - 1)),
            finish_reason=reason,
            timing={"finished_s": time.perf_counter() - began},
        )
