"""The native engine's attention variants: grouped-query attention (Llama, Qwen, Mixtral, OLMoE) and
DeepSeek's multi-head latent attention. Each reads its layer weights from a checkpoint, says what its
cache holds per token, and runs a prefill or a decode step against its cache.

Prefill (`bias` None): right-padded prompts attend causally among themselves (a real token never sees
the padding after it); what the cache keeps goes to slots [0, T) of cache rows `rows`.
Extend (`bias` None, `extend` given: extend.py): one row's new tokens continue its cache from its length;
their entries go to the cache, and each attends to the row's cache up to its own position.
Decode (T == 1): row b's entry goes to slot positions[b] of cache row rows[b], and it attends to the
cache's first S slots with the additive mask `bias` [B * mask_heads, group, S] (0 where visible, -inf
elsewhere; built by the engine from `mask_layout`).

Both attend with rotary position embedding in the rotate-half layout: `x * cos + roll(x) * sin`, sin
sign-folded (rotate_half(x) = [-x2, x1] = roll(x) * [-1, 1]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from everyprompt.rollout.native.families import Family, rope_tables
from everyprompt.rollout.native.site import Site
from everyprompt.rollout.native.weights import FP8Weight, Projection, StateDict, linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm as these families compute it (statistics in float32, scaled in the input's dtype); one
    fused op in float32. In a narrower dtype torch's op computes in float32 and rounds once, which is
    what upcasting, normalising and casting back does, in one kernel instead of three (a test checks
    the equality); the weight then scales in the input's dtype, as the families' own modules do."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    normed = F.rms_norm(x, x.shape[-1:], eps=eps)
    return normed if weight is None else weight * normed


def decode_bias(positions: torch.Tensor, width: int, dtype, mask_layout: tuple[int, int]) -> torch.Tensor:
    """A decode step's attention mask as an additive bias [B * heads, group, width] (an attention's
    `mask_layout`): row b sees its slots <= positions[b]. Built once per step for all layers."""
    visible = torch.arange(width, device=positions.device)[None, :] <= positions[:, None]
    bias = torch.zeros(visible.shape, dtype=dtype, device=positions.device)
    bias.masked_fill_(~visible, float("-inf"))
    heads, group = mask_layout
    return bias[:, None, None].expand(-1, heads, group, -1).reshape(-1, group, width)


class Rotary:
    """cos and sign-folded sin [B, T, 1, D] of a config's rotary embedding over `dim` channels."""

    def __init__(self, config, dim: int, dtype: torch.dtype):
        self.dim, self.dtype = dim, dtype
        self.inv_freq, self.scale = rope_tables(config, dim)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:  # once: the table follows the engine's device
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin() * self.scale
        sin[..., : self.dim // 2].neg_()
        return (emb.cos() * self.scale).to(self.dtype)[:, :, None], sin.to(self.dtype)[:, :, None]


def _rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = rope
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


@dataclass
class GroupedWeights:
    qkv: Projection  # [H, (heads + 2 kv_heads) * D]: query, key and value projections in one matmul
    o: Projection  # [heads * D, H]
    # qk_norm "head": [heads + kv_heads, D] (q_norm on every query head, k_norm on every key head);
    # "full": [(heads + kv_heads) * D] (q_norm over all query heads, then k_norm over all key heads)
    qk_norm: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None  # [(heads + 2 kv_heads) * D]
    o_bias: torch.Tensor | None = None  # [H]


class GroupedQueryAttention:
    """Multi-head attention with grouped key/value heads; the cache keeps each token's keys and values
    [kv_heads, D] per layer."""

    def __init__(self, config, family: Family, dtype: torch.dtype):
        self.family, self.dtype, self.eps = family, dtype, config.rms_norm_eps
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.clip_qkv = getattr(config, "clip_qkv", None)
        self.rotary = Rotary(config, self.head_dim, dtype)

    @property
    def cache_layout(self) -> list[tuple[int, int]]:
        return [(self.kv_heads, self.head_dim), (self.kv_heads, self.head_dim)]

    @property
    def mask_layout(self) -> tuple[int, int]:
        return self.kv_heads, self.heads // self.kv_heads

    def read(self, weights: StateDict, prefix: str) -> GroupedWeights:
        qkv = [prefix + f"{name}_proj.weight" for name in "qkv"]
        attn = GroupedWeights(
            qkv=weights.projection(*qkv),
            o=weights.projection(prefix + "o_proj.weight"),
            qkv_bias=weights.bias(*(name.replace("weight", "bias") for name in qkv)),
            o_bias=weights.bias(prefix + "o_proj.bias"),
        )
        if self.family.qk_norm == "head":
            q_norm, k_norm = weights.plain(prefix + "q_norm.weight"), weights.plain(prefix + "k_norm.weight")
            attn.qk_norm = torch.cat([q_norm.expand(self.heads, -1), k_norm.expand(self.kv_heads, -1)])
        elif self.family.qk_norm == "full":
            attn.qk_norm = torch.cat(
                [weights.plain(prefix + "q_norm.weight"), weights.plain(prefix + "k_norm.weight")]
            )
        return attn

    def __call__(self, w: GroupedWeights, x, rope, cache, site: Site) -> torch.Tensor:
        """Self-attention of x [B, T, H] against the cache rows of `site` (see the module docstring)."""
        rows, positions, bias, extend = site
        batch, length, _ = x.shape
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        qkv = linear(x, w.qkv)
        if w.qkv_bias is not None:
            qkv = qkv + w.qkv_bias
        qkv = qkv.view(batch, length, heads + 2 * kv_heads, dim)
        qk, v = self._qk_norm(w, qkv[:, :, : heads + kv_heads]), qkv[:, :, heads + kv_heads :]
        if self.clip_qkv is not None:  # OLMoE: query, key and value clamped after the norms
            qk, v = qk.clamp(-self.clip_qkv, self.clip_qkv), v.clamp(-self.clip_qkv, self.clip_qkv)
        qk = _rotate(qk, rope)
        q, k = qk[:, :, :heads], qk[:, :, heads:]
        k_cache, v_cache = cache
        if bias is None:
            if extend is None:  # a prefill: the new tokens are the whole sequence
                k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
                k_cache[rows, :, :length] = k
                v_cache[rows, :, :length] = v
                keys, values, mask = k, v, None
            else:  # an extend: the new tokens after each row's cached ones
                extend.write(k_cache, k)
                extend.write(v_cache, v)
                keys, values, mask = extend.read(k_cache), extend.read(v_cache), extend.mask
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=True
            )
            return _output(w, out.transpose(1, 2).reshape(batch, length, -1))
        k_cache[rows, :, positions] = k[:, 0]
        v_cache[rows, :, positions] = v[:, 0]
        width, group = bias.shape[-1], heads // kv_heads
        if self.dtype != torch.float32:  # the fused kernel keeps scores and softmax in float32
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k_cache[:, :, :width],
                v_cache[:, :, :width],
                attn_mask=bias.view(batch, heads, 1, width),
                enable_gqa=True,
            )
            return _output(w, out.transpose(1, 2).reshape(batch, 1, heads * dim))
        # one query per row, grouped heads as [B * kv_heads, group, D] against that row's cache: three
        # small kernels, faster than the fused one at this size
        keys = k_cache[:, :, :width].reshape(batch * kv_heads, width, dim)
        values = v_cache[:, :, :width].reshape(batch * kv_heads, width, dim)
        scores = torch.baddbmm(
            bias, q.reshape(batch * kv_heads, group, dim), keys.transpose(1, 2), alpha=dim**-0.5
        )
        out = torch.bmm(torch.softmax(scores, dim=-1), values).view(batch, 1, heads * dim)
        return _output(w, out)

    def prepare(self, w: GroupedWeights) -> None:
        """Nothing to derive from the weights before decoding."""

    def _qk_norm(self, w: GroupedWeights, qk: torch.Tensor) -> torch.Tensor:
        """The query and key heads qk [B, T, heads + kv_heads, D] normalised as the family does: per
        head (one RMSNorm call over all heads), over all query heads and all key heads, or not at all."""
        mode = self.family.qk_norm
        if mode == "none":
            return qk
        if mode == "head":
            return rms_norm(qk, None, self.eps) * w.qk_norm
        batch, length, heads = qk.shape[:3]
        width = self.heads * self.head_dim
        q = rms_norm(qk[:, :, : self.heads].reshape(batch, length, -1), w.qk_norm[:width], self.eps)
        k = rms_norm(qk[:, :, self.heads :].reshape(batch, length, -1), w.qk_norm[width:], self.eps)
        return torch.cat([q, k], dim=-1).view(batch, length, heads, self.head_dim)


@dataclass
class LatentWeights:
    q: Projection  # q_proj [H, heads * (nope + rope)], or q_b_proj [q_rank, ...] after q_a
    kv_a: Projection  # [H, kv_rank + rope]: the compressed key/value and the shared rotary key
    kv_a_norm: torch.Tensor  # [kv_rank]
    kv_b: Projection  # [kv_rank, heads * (nope + v)]: per-head keys (no rope) and values
    o: Projection  # [heads * v, H]
    q_a: Projection | None = None  # [H, q_rank] (q_lora_rank set)
    q_a_norm: torch.Tensor | None = None  # [q_rank]
    q_a_bias: torch.Tensor | None = None
    kv_a_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    # decode's absorbed forms of kv_b, laid out for batched matmuls over heads: W_k^T [heads, nope, rank]
    # and W_v^T [heads, rank, v]; made from the plain kv_b by `LatentAttention.prepare`, not at every step
    k_absorbed: torch.Tensor | None = None
    v_absorbed: torch.Tensor | None = None


class LatentAttention:
    """DeepSeek-V2/V3 multi-head latent attention (MLA). The cache keeps one vector per token and layer:
    the normalised compressed key/value c [kv_rank] and the roped shared key k_rot [rope], so a token
    costs kv_rank + rope values instead of 2 * heads * head_dim.

    Prefill expands c into per-head keys and values (`kv_b`) and attends as usual. Decode absorbs `kv_b`
    into the query instead: with kv_b = [W_k; W_v] per head, q_nope . (W_k c) = (W_k^T q_nope) . c, so
    every head scores [W_k^T q_nope, q_rot] against the cached [c, k_rot] (one shared key head, as in
    multi-query attention) and reads values as W_v (probs . c); nothing per head is cached or expanded.

    `rope_interleave` checkpoints rotate channel pairs (x0, x1), (x2, x3), ...; the rows of the rotary
    projections are reordered at load (evens, then odds) so the rotate-half rotation computes the same
    products in the same order.
    """

    def __init__(self, config, family: Family, dtype: torch.dtype):
        self.dtype = dtype
        self.eps = 1e-6  # transformers builds the q_a / kv_a norms with their default eps, not rms_norm_eps
        self.heads = config.num_attention_heads
        self.nope, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_rank = config.v_head_dim, config.kv_lora_rank
        self.q_rank = config.q_lora_rank
        self.interleaved = bool(getattr(config, "rope_interleave", False))
        self.scale = latent_softmax_scale(config)
        self.rotary = Rotary(config, self.rope_dim, dtype)

    @property
    def cache_layout(self) -> list[tuple[int, int]]:
        return [(1, self.kv_rank + self.rope_dim)]

    @property
    def mask_layout(self) -> tuple[int, int]:
        return 1, self.heads

    def read(self, weights: StateDict, prefix: str) -> LatentWeights:
        rope = self._deinterleave(self.rope_dim)
        q_rows = torch.cat(
            [
                h * (self.nope + self.rope_dim) + torch.cat([torch.arange(self.nope), self.nope + rope])
                for h in range(self.heads)
            ]
        )
        kv_rows = torch.cat([torch.arange(self.kv_rank), self.kv_rank + rope])
        q_name = prefix + ("q_b_proj.weight" if self.q_rank is not None else "q_proj.weight")
        attn = LatentWeights(
            q=weights.projection(q_name, rows=q_rows),
            kv_a=weights.projection(prefix + "kv_a_proj_with_mqa.weight", rows=kv_rows),
            kv_a_norm=weights.plain(prefix + "kv_a_layernorm.weight"),
            kv_b=weights.projection(prefix + "kv_b_proj.weight"),
            o=weights.projection(prefix + "o_proj.weight"),
            kv_a_bias=weights.bias(prefix + "kv_a_proj_with_mqa.bias", rows=kv_rows),
            o_bias=weights.bias(prefix + "o_proj.bias"),
        )
        if self.q_rank is not None:
            attn.q_a = weights.projection(prefix + "q_a_proj.weight")
            attn.q_a_norm = weights.plain(prefix + "q_a_layernorm.weight")
            attn.q_a_bias = weights.bias(prefix + "q_a_proj.bias")
        return attn

    def prepare(self, w: LatentWeights) -> None:
        """Decode's absorbed forms of `kv_b` (below), made once per weights: at a load, or for fp8 on
        the call's dequantised copy (a quantised `kv_b` is absorbed once dequantised)."""
        if isinstance(w.kv_b, FP8Weight):
            return
        rank, heads, nope = self.kv_rank, self.heads, self.nope
        kv_b = w.kv_b.reshape(rank, heads, nope + self.v_dim)  # c @ kv_b[:, h] = [k_nope_h, v_h]
        w.k_absorbed = kv_b[..., :nope].permute(1, 2, 0).contiguous()
        w.v_absorbed = kv_b[..., nope:].permute(1, 0, 2).contiguous()

    def _deinterleave(self, dim: int) -> torch.Tensor:
        """Row order of a rotary block: evens then odds for interleaved checkpoints, else unchanged."""
        if not self.interleaved:
            return torch.arange(dim)
        return torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2)])

    def __call__(self, w: LatentWeights, x, rope, cache, site: Site) -> torch.Tensor:
        """Self-attention of x [B, T, H] against the cache rows of `site` (see the module and class
        docstrings)."""
        rows, positions, bias, extend = site
        batch, length, _ = x.shape
        heads, nope, rank = self.heads, self.nope, self.kv_rank
        if w.q_a is not None:
            x_q = _add(x @ w.q_a, w.q_a_bias)
            q = rms_norm(x_q, w.q_a_norm, self.eps) @ w.q
        else:
            q = x @ w.q
        q = q.view(batch, length, heads, nope + self.rope_dim)
        q_nope, q_rot = q[..., :nope], _rotate(q[..., nope:], rope)
        kv = _add(x @ w.kv_a, w.kv_a_bias)  # [B, T, rank + rope]
        latent = torch.cat(
            [rms_norm(kv[..., :rank], w.kv_a_norm, self.eps), _rotate(kv[..., None, rank:], rope)[:, :, 0]],
            dim=-1,
        )
        (cache,) = cache
        if bias is None:
            if extend is None:  # a prefill: the new tokens are the whole sequence
                cache[rows, 0, :length] = latent
                mask = None
            else:  # an extend: the new tokens after each row's cached ones, which it reads back
                extend.write(cache, latent)
                latent, mask = extend.read(cache)[:, 0], extend.mask
            keys = latent.shape[1]
            k_nope, v = (
                (latent[..., :rank] @ w.kv_b).view(batch, keys, heads, -1).split([nope, self.v_dim], dim=-1)
            )
            k_rot = latent[:, :, None, rank:].expand(-1, -1, heads, -1)
            q = torch.cat([q_nope, q_rot], dim=-1).transpose(1, 2)  # [B, heads, T, nope + rope]
            k = torch.cat([k_nope, k_rot], dim=-1).transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q, k, v.transpose(1, 2), attn_mask=mask, is_causal=mask is None, scale=self.scale
            )
            return _output(w, out.transpose(1, 2).reshape(batch, length, -1))
        cache[rows, 0, positions] = latent[:, 0]
        width = bias.shape[-1]
        keys = cache[:, 0, :width]  # [B, S, rank + rope]
        q_latent = torch.bmm(q_nope[:, 0].transpose(0, 1), w.k_absorbed).transpose(0, 1)  # W_k^T q_nope
        query = torch.cat([q_latent, q_rot[:, 0]], dim=-1)  # [B, heads, rank + rope]
        scores = torch.baddbmm(bias, query, keys.transpose(1, 2), alpha=self.scale)  # [B, heads, S]
        probs = torch.softmax(scores.float(), dim=-1).to(keys.dtype)
        read = torch.bmm(probs, keys[..., :rank])  # [B, heads, rank]
        out = torch.bmm(read.transpose(0, 1), w.v_absorbed).transpose(0, 1)  # W_v (probs . c): [B, heads, v]
        return _output(w, out.reshape(batch, 1, heads * self.v_dim))


def latent_softmax_scale(config) -> float:
    """1 / sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under a scaled rope with
    `mscale_all_dim` (YaRN's attention temperature, as DeepSeek-V3's checkpoints set it)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = getattr(config, "rope_parameters", None) or {}
    all_dim = rope.get("mscale_all_dim", 0)
    if rope.get("rope_type", "default") != "default" and all_dim and rope["factor"] > 1:
        mscale = 0.1 * all_dim * math.log(rope["factor"]) + 1.0
        scale *= mscale * mscale
    return scale


def _add(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x if bias is None else x + bias


def _output(w, attended: torch.Tensor) -> torch.Tensor:
    return _add(linear(attended, w.o), w.o_bias)


ATTENTIONS = {"grouped": GroupedQueryAttention, "latent": LatentAttention}
