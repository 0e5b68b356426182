"""The native rollout engine: continuous batching over a preallocated KV cache, on the policy's weights.

It is a second implementation of the model's forward pass, written for decoding rather than gradients
(as vLLM is beside Megatron in production): no autograd, no module tree, one preallocated cache.
Supported architectures: Qwen3-MoE and Qwen3 (dense); the trainer's HF forward is the reference it is
tested against (log-probs equal within 1e-4 in fp32).

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
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from everyprompt.rollout.base import Completion, GenerationRequest, SamplingParams
from everyprompt.rollout.sampling import sample_tokens

SUPPORTED_ARCHITECTURES = ("qwen3_moe", "qwen3")


class UnsupportedModelError(ValueError):
    """The native engine has no forward pass for this architecture."""


@dataclass
class _Layer:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    router: torch.Tensor | None = None  # [E, H]
    gate_up: FP8Weight | None = None  # fp8 only: [E, 2I, H]
    down: FP8Weight | None = None  # fp8 only: [E, H, I]
    mlp_gate: torch.Tensor | None = None  # dense layers: [I, H]
    mlp_up: torch.Tensor | None = None
    mlp_down: torch.Tensor | None = None
    experts_dense: tuple[torch.Tensor, torch.Tensor] | None = None  # fp32 / bf16: [H, E * 2I], [E, I, H]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _expert_weights(layer: _Layer, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's projections as right operands: gate_up [H, 2I], down [I, H]."""
    if layer.experts_dense is not None:
        gate_up, down = layer.experts_dense
        width = gate_up.shape[1] // down.shape[0]
        return gate_up[:, expert * width : (expert + 1) * width], down[expert]
    return layer.gate_up[expert].T, layer.down[expert].T


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


E4M3_MAX = 448.0  # largest finite float8_e4m3fn value


class FP8Weight:
    """A linear weight [..., out, in] kept in float8_e4m3fn with one float32 scale per output channel.

    `.T` and indexing dequantise (weight-only FP8: activations stay in the engine's dtype), so the
    engine's matmul sites read the same as for a plain tensor.
    """

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self.data, self.scale, self.dtype = data, scale, dtype

    @classmethod
    def quantize(cls, weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> FP8Weight:
        weight = weight.detach().float()
        scale = (weight.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
        return cls((weight / scale).to(torch.float8_e4m3fn), scale, dtype)

    def dequantize(self) -> torch.Tensor:
        return (self.data.float() * self.scale).to(self.dtype)

    @property
    def T(self) -> torch.Tensor:  # noqa: N802  (mirrors Tensor.T)
        return self.dequantize().transpose(-2, -1)

    def __getitem__(self, index) -> FP8Weight:
        return FP8Weight(self.data[index], self.scale[index], self.dtype)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float32}


class NativeEngine:
    """RolloutEngine over a Qwen3(-MoE) state dict. Build it with :meth:`from_model` or the config."""

    def __init__(
        self,
        config,
        state_dict: dict[str, torch.Tensor],
        eos_token_id: int,
        pad_token_id: int,
        batch_size: int = 256,
        dtype: torch.dtype = torch.float32,
        precision: str | None = None,
    ):
        """`precision` (fp32 | bf16 | fp8) overrides `dtype`; fp8 keeps the attention and expert / MLP
        projections in float8_e4m3fn (per-output-channel scales, re-quantised by every `load_weights`),
        and embeddings, norms, routers and the LM head in float32."""
        if precision is not None:
            if precision not in PRECISIONS:
                raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
            dtype = PRECISIONS[precision]
        self.precision = precision or ("bf16" if dtype == torch.bfloat16 else "fp32")
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"the native rollout engine does not support model_type {model_type!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        self.config = config
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.batch_size, self.dtype = batch_size, dtype
        self.dense_moe_tokens = 256  # MoE layers over at most this many tokens run every expert densely
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.top_k = getattr(config, "num_experts_per_tok", 0)
        self.norm_topk_prob = getattr(config, "norm_topk_prob", False)
        theta = config.rope_parameters["rope_theta"]
        self.inv_freq = 1.0 / (
            theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim)
        )
        self._cache_storage: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._open_calls = 0  # generate() iterators not yet finished (the shared cache serves one)
        self.stats: dict[str, float] = {}  # the last generate call's throughput figures
        self.load_weights(state_dict)

    @classmethod
    def from_model(cls, model, tokenizer, batch_size: int = 256, precision: str = "fp32") -> NativeEngine:
        return cls(
            model.config,
            model.state_dict(),
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
            batch_size,
            precision=precision,
        )

    # ---------------------------------------------------------------- weights
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        def get(name: str) -> torch.Tensor:
            if name not in state_dict:
                raise KeyError(f"weight {name!r} missing from the state dict given to load_weights")
            return state_dict[name].detach().to(self.dtype).clone()

        def linear(name: str):
            if self.precision == "fp8":
                if name not in state_dict:
                    raise KeyError(f"weight {name!r} missing from the state dict given to load_weights")
                return FP8Weight.quantize(state_dict[name], self.dtype)
            return get(name)

        self.embed = get("model.embed_tokens.weight")
        self.final_norm = get("model.norm.weight")
        head = "lm_head.weight" if "lm_head.weight" in state_dict else "model.embed_tokens.weight"
        self.lm_head = get(head)
        self.layers = []
        for i in range(self.config.num_hidden_layers):
            p = f"model.layers.{i}."
            layer = _Layer(
                q=linear(p + "self_attn.q_proj.weight"),
                k=linear(p + "self_attn.k_proj.weight"),
                v=linear(p + "self_attn.v_proj.weight"),
                o=linear(p + "self_attn.o_proj.weight"),
                q_norm=get(p + "self_attn.q_norm.weight"),
                k_norm=get(p + "self_attn.k_norm.weight"),
                input_norm=get(p + "input_layernorm.weight"),
                post_norm=get(p + "post_attention_layernorm.weight"),
            )
            if p + "mlp.gate.weight" in state_dict:
                layer.router = get(p + "mlp.gate.weight")
                gate_up, down = linear(p + "mlp.experts.gate_up_proj"), linear(p + "mlp.experts.down_proj")
                if self.precision == "fp8":  # quantised per output channel in the checkpoint's layout
                    layer.gate_up, layer.down = gate_up, down
                else:  # one copy, laid out for matmuls from the left: [H, E * 2I] and [E, I, H]
                    experts, twice_inner, hidden = gate_up.shape
                    layer.experts_dense = (
                        gate_up.permute(2, 0, 1).reshape(hidden, experts * twice_inner).contiguous(),
                        down.transpose(1, 2).contiguous(),
                    )
            else:
                layer.mlp_gate = linear(p + "mlp.gate_proj.weight")
                layer.mlp_up = linear(p + "mlp.up_proj.weight")
                layer.mlp_down = linear(p + "mlp.down_proj.weight")
            self.layers.append(layer)

    # ---------------------------------------------------------------- forward pieces
    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype)[:, None], emb.sin().to(self.dtype)[:, None]  # [B, 1, T, D]

    def _attention(self, layer: _Layer, x: torch.Tensor, rope, cache, rows, positions, key_mask):
        """Self-attention of x [B, T, H] against the cache rows `rows`.

        Prefill (`key_mask` None): right-padded prompts attend causally among themselves (a real token never
        sees the padding after it); their keys/values go to cache slots [0, T) of rows `rows`.
        Decode (T == 1): row b's key/value goes to slot positions[b] of cache row rows[b], and it attends
        to the slots where key_mask [B, S] is true (the cache is read through its first S slots).
        """
        batch, length, _ = x.shape
        q = _rms_norm(
            (x @ layer.q.T).view(batch, length, self.num_heads, self.head_dim), layer.q_norm, self.eps
        )
        k = _rms_norm(
            (x @ layer.k.T).view(batch, length, self.num_kv_heads, self.head_dim), layer.k_norm, self.eps
        )
        v = (x @ layer.v.T).view(batch, length, self.num_kv_heads, self.head_dim)
        cos, sin = rope
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k_cache, v_cache = cache
        if key_mask is None:
            k_cache[rows, :, :length] = k
            v_cache[rows, :, :length] = v
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            k_cache[rows, :, positions] = k[:, :, 0]
            v_cache[rows, :, positions] = v[:, :, 0]
            width = key_mask.shape[-1]
            out = F.scaled_dot_product_attention(
                q,
                k_cache[:, :, :width],
                v_cache[:, :, :width],
                attn_mask=key_mask[:, None, None, :],
                enable_gqa=True,
            )
        return out.transpose(1, 2).reshape(batch, length, -1) @ layer.o.T

    def _moe(self, layer: _Layer, x: torch.Tensor, routes: list | None = None) -> torch.Tensor:
        """Top-k routed experts. With `routes` (a list), appends this layer's expert indices [B, T, k]."""
        flat = x.reshape(-1, x.shape[-1])  # [N, H]
        probs = torch.softmax((flat @ layer.router.T).float(), dim=-1)  # [N, E]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [N, k]
        if routes is not None:
            routes.append(experts.view(*x.shape[:2], self.top_k))
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(flat.dtype)
        if layer.experts_dense is not None and flat.shape[0] <= self.dense_moe_tokens:
            out = self._experts_dense(layer, flat, weights, experts)
        else:
            out = self._experts_grouped(layer, flat, weights, experts)
        return out.view_as(x)

    @staticmethod
    def _experts_dense(layer: _Layer, flat, weights, experts) -> torch.Tensor:
        """Every expert on every token in three batched matmuls, combined with the top-k gate weights
        (zero for the experts not chosen). E / k times the arithmetic of the grouped path but a handful
        of kernel launches instead of several per expert: the faster path for decode steps' few tokens."""
        gate_up, down = layer.experts_dense  # [H, E * 2I], [E, I, H]
        num_experts, inner = down.shape[0], down.shape[1]
        hidden = (flat @ gate_up).view(flat.shape[0], num_experts, 2 * inner)  # [N, E, 2I]
        act = F.silu(hidden[..., :inner]) * hidden[..., inner:]  # [N, E, I]
        per_expert = torch.bmm(act.transpose(0, 1), down)  # [E, N, H]
        gates = torch.zeros(flat.shape[0], num_experts, dtype=flat.dtype).scatter_(1, experts, weights)
        return torch.bmm(gates.unsqueeze(1), per_expert.transpose(0, 1)).squeeze(1)  # [N, H]

    @staticmethod
    def _experts_grouped(layer: _Layer, flat, weights, experts) -> torch.Tensor:
        """Experts one at a time over the tokens routed to each (the arithmetic of top-k only)."""
        top_k = experts.shape[1]
        out = torch.zeros_like(flat)
        token_of_pair = torch.arange(flat.shape[0]).repeat_interleave(top_k)  # [N*k]
        flat_experts = experts.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=layer.router.shape[0]).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start : start + count]
            start += count
            tokens = token_of_pair[pairs]
            gate_up, down = _expert_weights(layer, expert)
            gate, up = (flat[tokens] @ gate_up).chunk(2, dim=-1)
            hidden = (F.silu(gate) * up) @ down
            out.index_add_(0, tokens, hidden * weights.reshape(-1)[pairs, None])
        return out

    def _mlp(self, layer: _Layer, x: torch.Tensor, routes: list | None = None) -> torch.Tensor:
        if layer.router is not None:
            return self._moe(layer, x, routes)
        return (F.silu(x @ layer.mlp_gate.T) * (x @ layer.mlp_up.T)) @ layer.mlp_down.T

    def _forward(
        self, tokens, positions, caches, rows, key_mask, last, routes: list | None = None
    ) -> torch.Tensor:
        """Logits [B, V] at position `last` [B] of each row, the last position if None (see `_attention`
        for prefill vs decode).

        With `routes` (a list), appends each MoE layer's expert indices [B, T, k].
        """
        x = self.embed[tokens]
        rope = self._rope(positions)
        for layer, cache in zip(self.layers, caches):
            x = x + self._attention(
                layer, _rms_norm(x, layer.input_norm, self.eps), rope, cache, rows, positions[:, -1], key_mask
            )
            x = x + self._mlp(layer, _rms_norm(x, layer.post_norm, self.eps), routes)
        x = x[:, -1] if last is None else x[torch.arange(x.shape[0]), last]
        return (_rms_norm(x, self.final_norm, self.eps) @ self.lm_head.T).float()

    def _cache(self, slots: int, width: int, shared: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer key/value caches [slots, kv_heads, width, head_dim]: views of storage kept between
        calls and grown as calls need (`shared=False`: storage of its own, for a call made while another
        call's iterator is still open)."""

        def allocate(rows: int, columns: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
            shape = (rows, self.num_kv_heads, columns, self.head_dim)
            return [
                (torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype))
                for _ in self.layers
            ]

        if not shared:
            return allocate(slots, width)
        have = self._cache_storage[0][0] if self._cache_storage else None
        if have is None or have.dtype != self.dtype or have.shape[0] < slots or have.shape[2] < width:
            rows, columns = (
                (slots, width) if have is None else (max(slots, have.shape[0]), max(width, have.shape[2]))
            )
            self._cache_storage = allocate(rows, columns)
        return [(k[:slots, :, :width], v[:slots, :, :width]) for k, v in self._cache_storage]

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
        state = _Slots(pool, params.max_new_tokens, self.config.vocab_size)
        caches = self._cache(pool, width, shared)
        route_buffer = None
        queue = deque(range(len(requests)))
        clock = {
            "prefill_s": 0.0,
            "decode_s": 0.0,
            "decode_steps": 0,
            "busy": 0,
            "tokens": 0,
            "shrinks": 0,
            "admissions": 0,
        }
        while queue or bool((state.request >= 0).any()):
            free = (state.request < 0).nonzero().flatten()
            if queue and len(free):
                admitted = [queue.popleft() for _ in range(min(len(free), len(queue)))]
                tick = time.perf_counter()
                route_buffer = self._prefill(
                    requests, admitted, free[: len(admitted)], state, caches, params, route_buffer, width
                )
                clock["prefill_s"] += time.perf_counter() - tick
                clock["admissions"] += 1
            active = (state.request >= 0).nonzero().flatten()
            sampled, logprobs, entropies = sample_tokens(
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
            clock["tokens"] += len(active)
            finished = (sampled == self.eos_token_id) | (state.step[active] >= state.limit[active])
            for slot in active[finished].tolist():
                yield self._completion(requests[int(state.request[slot])], state, slot, route_buffer, began)
                state.request[slot] = -1
            running = active[~finished]
            if not len(running):
                continue
            if not queue and len(running) < len(state.request):
                # nothing left to admit: move the running rows to the front and drop the idle ones (on
                # CPU a decode step's cost follows its rows; copying the cache is cheaper than idle rows)
                caches, route_buffer = self._compact(running, state, caches, route_buffer)
                running = torch.arange(len(running))
                clock["shrinks"] += 1
            fed = sampled[~finished]
            tick = time.perf_counter()
            rows = torch.arange(len(state.request))
            tokens = torch.full_like(rows, self.pad_token_id)
            tokens[running] = fed
            positions = state.length  # idle rows write at their own (free) row's stale length
            key_mask = torch.arange(int(positions.max()) + 1)[None, :] <= positions[:, None]
            routes: list | None = [] if route_buffer is not None else None
            logits = self._forward(tokens[:, None], positions[:, None], caches, rows, key_mask, None, routes)
            state.logits[running] = logits[running]
            if routes:
                route_buffer[running, state.length[running]] = torch.stack(routes, dim=2)[running, 0].to(
                    torch.int16
                )
            state.length[running] += 1
            clock["decode_s"] += time.perf_counter() - tick
            clock["decode_steps"] += 1
            clock["busy"] += len(running) / pool
        wall = time.perf_counter() - began
        steps = max(clock["decode_steps"], 1)
        self.stats = {
            "tokens": float(clock["tokens"]),
            "tokens_per_s": clock["tokens"] / wall if wall > 0 else 0.0,
            "slot_occupancy": clock["busy"] / steps,
            "decode_step_ms": 1000 * clock["decode_s"] / steps,
            "decode_steps": float(clock["decode_steps"]),
            "prefill_s": clock["prefill_s"],
            "wall_s": wall,
            "slots": float(pool),
            "pool_shrinks": float(clock["shrinks"]),
            "admissions": float(clock["admissions"]),
        }

    def _prefill(self, requests, admitted, slots, state, caches, params, route_buffer, width):
        """Run the admitted prompts (right-padded) into cache rows `slots`; their next-token logits become
        the rows' pending logits. Returns the route buffer (created on first use when recording)."""
        prompts = [requests[i].prompt_ids for i in admitted]
        lengths = torch.tensor([len(p) for p in prompts])
        tokens = torch.full((len(prompts), int(lengths.max())), self.pad_token_id, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = torch.tensor(prompt)
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        routes: list | None = [] if params.record_routes else None
        logits = self._forward(tokens, positions, caches, slots, None, lengths - 1, routes)
        if routes is not None:
            if not routes:
                raise UnsupportedModelError(
                    "record_routes needs a mixture-of-experts model; this one has no router"
                )
            if route_buffer is None:
                # [slots, width, L_moe, k]: each row's prompt routes from slot 0, then each fed token's
                route_buffer = torch.zeros(
                    len(state.request), width, len(routes), self.top_k, dtype=torch.int16
                )
            route_buffer[slots, : tokens.shape[1]] = torch.stack(routes, dim=2).to(torch.int16)
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
        return route_buffer

    def _compact(self, running, state, caches, route_buffer):
        """Move the running rows to cache rows [0, n) and shrink the pool to n rows."""
        n = len(running)
        compacted = []
        for k, v in caches:
            k[:n] = k[running]
            v[:n] = v[running]
            compacted.append((k[:n], v[:n]))
        state.select(running)
        if route_buffer is not None:
            route_buffer = route_buffer[running]
        return compacted, route_buffer

    def _completion(self, request, state, slot: int, route_buffer, began: float) -> Completion:
        length = int(state.step[slot])
        token_ids = state.tokens[slot, :length].tolist()
        reason = "eos" if token_ids[-1] == self.eos_token_id else "length"
        return Completion(
            request_id=request.request_id,
            prompt_ids=list(request.prompt_ids),
            token_ids=token_ids,
            logprobs=state.logprobs[slot, :length].clone(),
            entropies=state.entropies[slot, :length].clone(),
            # the last sampled token was never fed, so it has no route
            routed_experts=None
            if route_buffer is None
            else route_buffer[slot, : len(request.prompt_ids) + length - 1].clone(),
            finish_reason=reason,
            timing={"finished_s": time.perf_counter() - began},
        )


class _Slots:
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
