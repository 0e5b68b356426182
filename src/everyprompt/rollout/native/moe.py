"""The native engine's mixture-of-experts layer: a router picks top-k experts per token and weighs them
(`ROUTERS`: softmax top-k, or DeepSeek-V3's grouped sigmoid top-k with a score-correction bias), the
chosen experts' SwiGLU outputs are summed with those weights, and a shared expert is added where the
family has one. The experts run batched (all in two bmm calls over padded row blocks) for decode steps and
short prefills; on the CPU, experts too large for its caches run as grouped matmuls over the tokens routed
to each (two `grouped_mm` calls: only the chosen experts' weights are read, with no Python loop; one
opaque operator in a compiled step); long prefills run one expert at a time over its own tokens. All give
the same result up to float rounding.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from everyprompt.rollout.native.families import Family
from everyprompt.rollout.native.weights import Layer, linear


@dataclass(frozen=True)
class Routing:
    """A config's routing settings."""

    top_k: int
    renormalise: bool  # top-k weights divided by their sum
    groups: int = 1  # grouped routing: experts split into `groups` groups ...
    top_groups: int = 1  # ... of which the `top_groups` best (by their two best scores) are eligible
    scaling: float = 1.0  # the chosen weights' final factor (DeepSeek-V3's routed_scaling_factor)

    @classmethod
    def of(cls, config, family: Family) -> Routing:
        renormalise = family.renormalise
        if renormalise is None:
            renormalise = bool(getattr(config, "norm_topk_prob", False))
        return cls(
            top_k=getattr(config, "num_experts_per_tok", 0),
            renormalise=renormalise,
            groups=getattr(config, "n_group", None) or 1,
            top_groups=getattr(config, "topk_group", None) or 1,
            scaling=getattr(config, "routed_scaling_factor", None) or 1.0,
        )


# an expert this large (its gate/up and down weights) runs grouped on the CPU (MixtureOfExperts._path)
GROUPED_EXPERT_BYTES = 1 << 20

# torch's grouped matmul (torch.nn.functional.grouped_mm, public in recent torch; on the CPU for 16-byte
# aligned operands)
GROUPED_MM = hasattr(F, "grouped_mm")

Experts = Callable[..., torch.Tensor]  # (gate_up, down, flat, weights, experts) -> out
Router = Callable[[torch.Tensor, "torch.Tensor | None", Routing], "tuple[torch.Tensor, torch.Tensor]"]
ROUTERS: dict[str, Router] = {}


def register_router(name: str):
    def add(function: Router) -> Router:
        ROUTERS[name] = function
        return function

    return add


@register_router("softmax")
def softmax_top_k(logits: torch.Tensor, bias: torch.Tensor | None, routing: Routing):
    """Weights [N, k] and experts [N, k] of the softmax's top k (Qwen, Mixtral, OLMoE). Renormalised, the
    weights are the softmax of the k chosen logits: the full softmax's top k divided by their sum is
    exp(l_i - m) / sum over the k of exp(l_j - m), the same numbers up to a rounding, in two kernels where
    softmax, top-k, sum and division took four (a decode step runs them at every MoE layer)."""
    if routing.renormalise:
        chosen, experts = torch.topk(logits, routing.top_k, dim=-1)
        return torch.softmax(chosen, dim=-1), experts
    weights, experts = torch.topk(torch.softmax(logits, dim=-1), routing.top_k, dim=-1)
    return weights, experts


@register_router("grouped_sigmoid")
def grouped_sigmoid_top_k(logits: torch.Tensor, bias: torch.Tensor | None, routing: Routing):
    """DeepSeek-V3's routing: scores sigmoid(logits); experts chosen by score + bias, only within the
    `top_groups` groups whose two best biased scores sum highest; weights are the chosen experts' unbiased
    scores (renormalised), times `scaling`."""
    scores = torch.sigmoid(logits)  # [N, E]
    choice = scores if bias is None else scores + bias
    tokens, num_experts = choice.shape
    per_group = num_experts // routing.groups
    group_scores = choice.view(tokens, routing.groups, per_group).topk(2, dim=-1).values.sum(-1)
    best = torch.topk(group_scores, routing.top_groups, dim=-1, sorted=False).indices
    eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    choice = choice.masked_fill(~eligible.repeat_interleave(per_group, dim=1), float("-inf"))
    experts = torch.topk(choice, routing.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, experts)
    if routing.renormalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.scaling, experts


class MixtureOfExperts:
    """The MoE layer of a config: `self(layer, x, routes)`."""

    def __init__(self, config, family: Family):
        self.routing = Routing.of(config, family)
        self.route = ROUTERS[family.router]
        self.batched_tokens = 512  # at most this many tokens: all experts in one bmm

    def _path(self, flat: torch.Tensor, gate_up, down) -> Experts:
        """How the experts run: grouped matmuls where a CUDA device's grouped GEMM takes them; else batched
        up to `batched_tokens` tokens, on the CPU except for experts whose
        weights do not fit its caches (`GROUPED_EXPERT_BYTES` or more each): a decode step there is bound
        by reading weights, and grouped matmuls read only the chosen experts' (SmolLM2's 8-expert upcycle,
        one expert at a time, batch 64: 357 ms a step against 457 ms batched; batch 1: 47 against 159); a
        compiled step calls them as one operator (`routed_experts`). Longer inputs: one expert at a time.

        A compiled step on an accelerator calls `routed_experts` too, which chooses between grouped and
        batched matmuls as it runs: whether the grouped GEMM takes the weights (their addresses) and runs
        on the device (a kernel tried once) cannot be asked while torch.compile traces (torch 2.13 refuses
        to trace an address: the compile was given up, or ended a run that compiles without graphs)."""
        long = flat.shape[0] > self.batched_tokens
        if _accelerated(flat):
            if torch.compiler.is_compiling():
                return routed_experts
            path = _device_path(flat, gate_up, down)
            # a long prefill without grouped matmuls: one expert at a time (eager; a prefill is never captured)
            return experts_grouped if long and path is experts_batched else path
        if long:
            return experts_grouped
        if _expert_bytes(gate_up, down, gate_up.element_size()) < GROUPED_EXPERT_BYTES:
            return experts_batched
        # compiled: one opaque operator in the graph (its data-dependent shapes stay inside it)
        return routed_experts if torch.compiler.is_compiling() else experts_routed

    def __call__(self, layer: Layer, x: torch.Tensor, routes: list | None = None) -> torch.Tensor:
        """Top-k routed experts of x [B, T, H]. With `routes` (a list), appends this layer's (expert
        indices [B, T, k], router logits [B, T, E])."""
        flat = x.reshape(-1, x.shape[-1])  # [N, H]
        logits = (flat @ layer.router).float()  # [N, E]
        weights, experts = self.route(logits, layer.router_bias, self.routing)  # [N, k]
        if routes is not None:
            routes.append((experts.view(*x.shape[:2], -1), logits.view(*x.shape[:2], -1)))
        weights = weights.to(flat.dtype)
        gate_up, down = layer.experts
        path = self._path(flat, gate_up, down)
        out = path(gate_up, down, flat, weights, experts)
        if layer.shared is not None:
            shared = swiglu(layer.shared, flat)
            if layer.shared_gate is not None:
                shared = torch.sigmoid(flat @ layer.shared_gate) * shared
            out = out + shared
        return out.view_as(x)


def _accelerated(flat: torch.Tensor) -> bool:
    """Whether the experts run on an accelerator (no host read of the routing on the way)."""
    return flat.device.type != "cpu"


def _device_path(flat: torch.Tensor, gate_up, down) -> Experts:
    """The experts' path on an accelerator: grouped matmuls where its grouped GEMM takes the operands, else
    the batched path; neither reads the device back, so either captures into a CUDA graph."""
    return experts_grouped_mm if _grouped_on_device(flat, gate_up, down) else experts_batched


def _expert_bytes(gate_up, down, itemsize: int) -> int:
    """The bytes of one expert's weights (its gate/up and down projections, [E, ...] each)."""
    return (math.prod(gate_up.shape[1:]) + math.prod(down.shape[1:])) * itemsize


def _aligned(gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether `grouped_mm` takes these experts: it needs its operands to start on 16 bytes and every
    stride a multiple of 16 bytes, so the hidden and inner sizes (down [E, I, H]; gate_up [E, H, 2I]) in
    16-byte units (the activations it multiplies are then aligned too)."""
    sizes = all(size * down.element_size() % 16 == 0 for size in down.shape[1:])
    return sizes and gate_up.data_ptr() % 16 == 0 and down.data_ptr() % 16 == 0


def _grouped_on_device(flat: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether an accelerator runs these experts as grouped matmuls (each expert over its own tokens, the
    offsets computed on the device): CUDA's grouped GEMM takes bfloat16 on compute capability 8.0 and up,
    with aligned operands. Elsewhere the batched path (blocks as wide as the worst case) runs."""
    if not GROUPED_MM or flat.dtype != torch.bfloat16 or flat.device.type != "cuda":
        return False
    return _aligned(gate_up, down) and _grouped_mm_runs(flat.device)


@functools.cache
def _grouped_mm_runs(device: torch.device) -> bool:
    """Whether this CUDA device's grouped GEMM runs and agrees with plain matmuls, tried once on small
    bf16 operands (compute capability 8.0 and up; never on a fake CUDA device): where it does not, the
    batched path runs instead of a run failing at its first MoE layer."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(device) < (8, 0):
        return False
    try:
        generator = torch.Generator(device="cpu").manual_seed(0)
        a = torch.randn(24, 32, generator=generator).to(device, torch.bfloat16)
        b = torch.randn(3, 32, 16, generator=generator).to(device, torch.bfloat16)
        ends = torch.tensor([8, 8, 24], dtype=torch.int32, device=device)  # the second group is empty
        out = F.grouped_mm(a, b, offs=ends)
        expected = torch.cat([a[:8] @ b[0], a[8:24] @ b[2]])
        return bool(torch.allclose(out.float(), expected.float(), atol=0.1, rtol=0.05))
    except Exception:  # noqa: BLE001 (an unsupported kernel: the batched path serves)
        return False


def _by_expert(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, k) pairs of `experts` [N, k] grouped by expert: their order (pair i is token i // k's
    choice) and each expert's pair count [E] (a scatter-add: a static size, so it compiles)."""
    flat_experts = experts.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=experts.device)
    return order, counts.scatter_add_(0, flat_experts, torch.ones_like(order))


def swiglu(pair, x: torch.Tensor) -> torch.Tensor:
    gate_up, down = pair
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, down)


def experts_batched(gate_up, down, flat, weights, experts) -> torch.Tensor:
    """All experts in two batched matmuls: each expert's tokens gathered into a row block [E, C, H]
    (C = the busiest expert's token count; shorter blocks padded with a zero row), so the arithmetic
    is top-k's plus the padding and the kernel count does not grow with E; each token's k expert
    outputs are then gathered from the blocks and summed with their weights. gate_up [E, H, 2I],
    down [E, I, H]."""
    tokens, top_k = experts.shape
    num_experts, inner = down.shape[0], down.shape[1]
    order, counts = _by_expert(experts, num_experts)
    device = flat.device
    sorted_experts = experts.reshape(-1)[order]
    column = torch.arange(len(order), device=device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    if device.type == "cpu":
        # the busiest expert's count: reading it costs nothing on the CPU. A compiled decode step keeps it
        # as an unbacked size, which the bound (at least 2: a zero row more when no expert has two
        # tokens) lets the bmm lowering reason about
        capacity = int(counts.max().clamp(min=2))
        torch._check(capacity >= 2)
    else:
        # on an accelerator reading it back would stall every layer of every step: blocks as wide as the
        # most any expert can get (each token picks an expert at most once), padding instead of a sync
        capacity = max(tokens, 2)
    index = torch.full((num_experts, capacity), tokens, dtype=torch.long, device=device)  # row `tokens`: 0
    index[sorted_experts, column] = order // top_k
    slot = torch.empty_like(order)
    slot[order] = sorted_experts * capacity + column  # each (token, k) pair's row of the [E * C] output
    rows = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])[index]  # [E, C, H]
    hidden = torch.bmm(rows, gate_up)  # [E, C, 2I]
    act = F.silu(hidden[..., :inner]) * hidden[..., inner:]
    # each token's k outputs gathered back and weighed: a gather and a sum, no scatter-add
    out = torch.bmm(act, down).view(-1, flat.shape[1])[slot].view(tokens, top_k, -1)
    return (out.float() * weights.float()[..., None]).sum(1).to(out.dtype)  # bf16: summed in float32


def experts_routed(gate_up, down, flat, weights, experts) -> torch.Tensor:
    """The routed experts over their own tokens only: grouped matmuls, or one expert at a time where
    `grouped_mm` cannot take the operands. On an accelerator (a compiled step's `routed_experts`), what
    `MixtureOfExperts._path` runs there eagerly: grouped matmuls where its grouped GEMM takes them, else
    the batched path (no host read: the step may be captured into a CUDA graph)."""
    if _accelerated(flat):
        path = _device_path(flat, gate_up, down)
    else:
        path = experts_grouped_mm if GROUPED_MM and _aligned(gate_up, down) else experts_grouped
    return path(gate_up, down, flat, weights, experts)


@torch.library.custom_op("everyprompt::routed_experts", mutates_args=())
def routed_experts(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    flat: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
) -> torch.Tensor:
    """`experts_routed` as one operator, for a compiled decode step: the graph calls it as it is (its
    data-dependent shapes stay inside), so a compiled step reads only the routed experts' weights too; on
    an accelerator, it chooses its path as it runs, where the weights' addresses can be read."""
    return experts_routed(gate_up, down, flat, weights, experts)


@routed_experts.register_fake
def _(gate_up, down, flat, weights, experts):
    return torch.empty_like(flat)


def experts_grouped_mm(gate_up, down, flat, weights, experts) -> torch.Tensor:
    """The (token, k) pairs sorted by expert, each projection one grouped matmul over the experts' row
    ranges (`grouped_mm`: an expert with no tokens is never read, and there is no per-expert Python
    loop of ~8 operators; SmolLM2's 8-expert upcycle decodes ~5% faster at batch 8 and 32,
    docs/performance.md); each token's k outputs put back in order and summed with their weights. What a
    CUDA device runs for bf16 experts: 11 kernels (18 before 2026-11-28: tests/rollout/test_native_moe.py)."""
    tokens, top_k = experts.shape
    # the pairs by expert (a stable sort: `_by_expert`'s order) and each expert's end among them, found in
    # the sorted experts: three kernels where counting and summing took five
    sorted_experts, order = torch.sort(experts.reshape(-1), stable=True)
    ids = torch.arange(down.shape[0], device=experts.device)
    ends = torch.searchsorted(sorted_experts, ids, right=True, out_int32=True)
    hidden = F.grouped_mm(flat[order // top_k], gate_up, offs=ends)  # [N * k, 2I]
    inner = down.shape[1]
    out = F.grouped_mm(F.silu(hidden[:, :inner]) * hidden[:, inner:], down, offs=ends)  # [N * k, H]
    # back in (token, k) order: one scatter where inverting the permutation took a sort and a gather
    out = out.new_empty(out.shape).index_copy_(0, order, out).view(tokens, top_k, -1)
    # each token's k outputs weighed and summed as one batched product [1, k] x [k, H]: one kernel for the
    # five of casting, multiplying, summing and casting back; bf16 accumulates in float32 as before (equal
    # bit for bit at k = 2), float32 within a rounding (fused multiply-adds)
    return torch.bmm(weights.to(out.dtype).unsqueeze(1), out).squeeze(1)


def experts_grouped(gate_up, down, flat, weights, experts) -> torch.Tensor:
    """Experts one at a time over the tokens routed to each (no padding: for long prefills, where
    one expert's share can be far above the mean)."""
    top_k = experts.shape[1]
    out = torch.zeros_like(flat)
    order, counts = _by_expert(experts, down.shape[0])
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        gate, up = (flat[tokens] @ gate_up[expert]).chunk(2, dim=-1)
        hidden = (F.silu(gate) * up) @ down[expert]
        out.index_add_(0, tokens, hidden * weights.reshape(-1)[pairs, None])
    return out
