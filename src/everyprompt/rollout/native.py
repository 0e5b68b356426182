"""The native rollout engine: batched decoding with a preallocated KV cache over the policy's weights.

It is a second implementation of the model's forward pass, written for decoding rather than gradients
(as vLLM is beside Megatron in production): no autograd, no module tree, one preallocated cache, finished
rows dropped from the batch as they end. Supported architectures: Qwen3-MoE and Qwen3 (dense); the
trainer's HF forward is the reference it is tested against (log-probs equal within 1e-4 in fp32).

Layout of one batch: prompts are left-padded to a common length P; row b's prompt occupies cache slots
[P - len_b, P), its positions start at 0 there, and generated token t sits in slot P + t at position
len_b + t. A key slot is visible to row b iff it is at or after P - len_b (and causal).
"""

from __future__ import annotations

import time
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
    gate_up: torch.Tensor | None = None  # [E, 2I, H]
    down: torch.Tensor | None = None  # [E, H, I]
    mlp_gate: torch.Tensor | None = None  # dense layers: [I, H]
    mlp_up: torch.Tensor | None = None
    mlp_down: torch.Tensor | None = None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


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
                layer.gate_up = linear(p + "mlp.experts.gate_up_proj")
                layer.down = linear(p + "mlp.experts.down_proj")
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

    def _attention(self, layer: _Layer, x: torch.Tensor, rope, cache, slot: int, key_mask: torch.Tensor):
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
        k_cache[:, :, slot : slot + length] = k
        v_cache[:, :, slot : slot + length] = v
        end = slot + length
        out = F.scaled_dot_product_attention(
            q, k_cache[:, :, :end], v_cache[:, :, :end], attn_mask=key_mask[:, None, :, :end], enable_gqa=True
        )
        return out.transpose(1, 2).reshape(batch, length, -1) @ layer.o.T

    def _moe(self, layer: _Layer, x: torch.Tensor, routes: list | None = None) -> torch.Tensor:
        """Top-k routed experts, computed one expert at a time over the tokens routed to it.

        With `routes` (a list), appends this layer's expert indices [B, T, k].
        """
        flat = x.reshape(-1, x.shape[-1])  # [N, H]
        probs = torch.softmax((flat @ layer.router.T).float(), dim=-1)  # [N, E]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [N, k]
        if routes is not None:
            routes.append(experts.view(*x.shape[:2], self.top_k))
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(flat.dtype)
        out = torch.zeros_like(flat)
        token_of_pair = torch.arange(flat.shape[0]).repeat_interleave(self.top_k)  # [N*k]
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
            gate, up = (flat[tokens] @ layer.gate_up[expert].T).chunk(2, dim=-1)
            hidden = (F.silu(gate) * up) @ layer.down[expert].T
            out.index_add_(0, tokens, hidden * weights.reshape(-1)[pairs, None])
        return out.view_as(x)

    def _mlp(self, layer: _Layer, x: torch.Tensor, routes: list | None = None) -> torch.Tensor:
        if layer.router is not None:
            return self._moe(layer, x, routes)
        return (F.silu(x @ layer.mlp_gate.T) * (x @ layer.mlp_up.T)) @ layer.mlp_down.T

    def _forward(
        self, tokens, positions, caches, slot: int, key_mask, routes: list | None = None
    ) -> torch.Tensor:
        """Logits [B, V] of the last position; writes keys/values at cache slots [slot, slot + T).

        With `routes` (a list), appends each MoE layer's expert indices [B, T, k].
        """
        x = self.embed[tokens]
        rope = self._rope(positions)
        for layer, cache in zip(self.layers, caches):
            x = x + self._attention(
                layer, _rms_norm(x, layer.input_norm, self.eps), rope, cache, slot, key_mask
            )
            x = x + self._mlp(layer, _rms_norm(x, layer.post_norm, self.eps), routes)
        return (_rms_norm(x[:, -1], self.final_norm, self.eps) @ self.lm_head.T).float()

    # ---------------------------------------------------------------- decoding
    @torch.inference_mode()
    def generate(self, requests: Iterable[GenerationRequest], params: SamplingParams) -> Iterator[Completion]:
        pending = list(requests)
        for start in range(0, len(pending), self.batch_size):
            yield from self._generate_batch(pending[start : start + self.batch_size], params)

    def _generate_batch(
        self, requests: list[GenerationRequest], params: SamplingParams
    ) -> Iterator[Completion]:
        began = time.perf_counter()
        lengths = torch.tensor([len(r.prompt_ids) for r in requests])
        if int(lengths.min()) == 0:
            raise ValueError("a generation request has an empty prompt")
        batch, prompt_len = len(requests), int(lengths.max())
        total = prompt_len + params.max_new_tokens
        tokens = torch.full((batch, prompt_len), self.pad_token_id, dtype=torch.long)
        for row, request in enumerate(requests):
            tokens[row, prompt_len - len(request.prompt_ids) :] = torch.tensor(request.prompt_ids)
        offsets = prompt_len - lengths  # first real slot per row
        slots = torch.arange(total)
        visible = slots[None, :] >= offsets[:, None]  # [B, total]
        causal = slots[None, None, :] <= slots[None, :prompt_len, None]  # [1, P, total]
        prefill_mask = visible[:, None, :] & causal  # [B, P, total]
        positions = (slots[None, :prompt_len] - offsets[:, None]).clamp(min=0)
        shape = (batch, self.num_kv_heads, total, self.head_dim)
        caches = [
            (torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype)) for _ in self.layers
        ]
        routes: list | None = [] if params.record_routes else None
        logits = self._forward(tokens, positions, caches, 0, prefill_mask, routes)
        route_buffer = None
        if routes is not None:
            if not routes:
                raise UnsupportedModelError(
                    "record_routes needs a mixture-of-experts model; this one has no router"
                )
            # [B, P + max_new_tokens, L_moe, k]: the prompt's routes (left-padded), then each fed token's
            route_buffer = torch.zeros(
                batch, prompt_len + params.max_new_tokens, len(routes), self.top_k, dtype=torch.int16
            )
            route_buffer[:, :prompt_len] = torch.stack(routes, dim=2).to(torch.int16)

        seeds = torch.tensor([r.seed for r in requests], dtype=torch.long)
        rows = torch.arange(batch)  # original row of each active row
        out_tokens = torch.full((batch, params.max_new_tokens), self.pad_token_id, dtype=torch.long)
        out_logprobs = torch.zeros(batch, params.max_new_tokens)
        out_entropies = torch.zeros(batch, params.max_new_tokens)
        for step in range(params.max_new_tokens):
            step_index = torch.full_like(rows, step)
            sampled, logprobs, entropies = sample_tokens(
                logits, seeds[rows], step_index, params.temperature, params.top_p, params.greedy
            )
            out_tokens[rows, step] = sampled
            out_logprobs[rows, step] = logprobs
            out_entropies[rows, step] = entropies
            finished = sampled == self.eos_token_id
            if step == params.max_new_tokens - 1:
                finished = torch.ones_like(finished)
            for index in finished.nonzero().flatten().tolist():
                yield self._completion(
                    requests,
                    int(rows[index]),
                    out_tokens,
                    out_logprobs,
                    out_entropies,
                    step + 1,
                    began,
                    route_buffer,
                    int(offsets[rows[index]]),
                )
            if bool(finished.all()):
                break
            keep = (~finished).nonzero().flatten()
            if len(keep) < len(rows):
                rows, sampled, visible = rows[keep], sampled[keep], visible[keep]
                caches = [(k[keep], v[keep]) for k, v in caches]
            slot = prompt_len + step
            step_positions = (lengths[rows] + step)[:, None]
            routes = [] if route_buffer is not None else None
            logits = self._forward(
                sampled[:, None], step_positions, caches, slot, visible[:, None, :], routes
            )
            if routes:
                route_buffer[rows, slot] = torch.stack(routes, dim=2)[:, 0].to(torch.int16)

    def _completion(
        self,
        requests,
        row: int,
        out_tokens,
        out_logprobs,
        out_entropies,
        length: int,
        began: float,
        route_buffer: torch.Tensor | None = None,
        offset: int = 0,
    ) -> Completion:
        token_ids = out_tokens[row, :length].tolist()
        reason = "eos" if token_ids[-1] == self.eos_token_id else "length"
        request = requests[row]
        return Completion(
            request_id=request.request_id,
            prompt_ids=list(request.prompt_ids),
            token_ids=token_ids,
            logprobs=out_logprobs[row, :length].clone(),
            entropies=out_entropies[row, :length].clone(),
            # prompt slots start at the row's left-padding offset; the last sampled token was never fed
            routed_experts=None
            if route_buffer is None
            else route_buffer[row, offset : offset + len(request.prompt_ids) + length - 1].clone(),
            finish_reason=reason,
            timing={"finished_s": time.perf_counter() - began},
        )
