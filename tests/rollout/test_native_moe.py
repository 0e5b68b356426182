"""The native engine's mixture-of-experts layer: its expert paths against a per-token reference and each
other, routing by hand, and the routes and router logits it records against the HF routers."""

import math
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from everyprompt.rollout import SamplingParams, UnsupportedModelError
from everyprompt.rollout.native import NativeEngine
from tests.rollout.test_native import PROMPTS, _requests


def test_routes_are_not_recorded_unless_asked(tiny_model):
    model, tokenizer = tiny_model
    engine = NativeEngine.from_model(model, tokenizer)
    completion = next(iter(engine.generate(_requests(tokenizer, PROMPTS[:1]), SamplingParams(4))))
    assert completion.routed_experts is None


def test_batched_experts_equal_a_per_token_reference():
    """The padded batched path against the definition: each token's output is the gate-weighted sum of
    its top-k experts' SwiGLU outputs. Expert 3 gets no token, expert 0 most of them (padding)."""
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    tokens, hidden, inner, num_experts = 7, 8, 4, 4  # sizes in 16-byte units, as grouped_mm wants
    flat = torch.randn(tokens, hidden, generator=generator)
    gate_up = torch.randn(num_experts, hidden, 2 * inner, generator=generator)
    down = torch.randn(num_experts, inner, hidden, generator=generator)
    experts = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 2], [2, 0], [0, 1], [1, 2]])
    weights = torch.rand(tokens, 2, generator=generator)
    expected = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for k in range(2):
            e = int(experts[t, k])
            gate, up = (flat[t] @ gate_up[e]).chunk(2)
            expected[t] += weights[t, k] * ((F.silu(gate) * up) @ down[e])
    from everyprompt.rollout.native.moe import experts_batched, experts_grouped, experts_grouped_mm

    column_major = (gate_up.transpose(1, 2).contiguous().transpose(1, 2), down)  # as fp8's operand() gives
    for path in (experts_batched, experts_grouped, experts_grouped_mm):
        for operands in ((gate_up, down), column_major):
            got = path(*operands, flat, weights, experts)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # a last expert no token chose: an empty last group, which changes nothing
    unused = torch.cat([gate_up, torch.full_like(gate_up[:1], float("nan"))])
    got = experts_grouped_mm(unused, torch.cat([down, down[:1]]), flat, weights, experts)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_renormalised_softmax_routing_by_hand_and_in_two_kernels():
    """Renormalised top-k routing (Mixtral, Qwen3-MoE) as the softmax of the chosen logits: by hand, and
    transformers' form (the full softmax's top k divided by their sum) on random logits, in two operators
    where that form takes four; without renormalising, the full softmax's top k as it was."""
    from everyprompt.rollout.native.moe import Routing, softmax_top_k

    e = math.e
    weights, experts = softmax_top_k(torch.tensor([[1.0, 2.0, 3.0, 0.0]]), None, Routing(2, renormalise=True))
    assert experts.tolist() == [[2, 1]]
    torch.testing.assert_close(weights, torch.tensor([[e / (e + 1), 1 / (e + 1)]]))  # softmax of [3, 2]
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0)) * 3
    full, chosen = torch.topk(torch.softmax(logits, -1), 2, dim=-1)
    with Kernels() as kernels:
        weights, experts = softmax_top_k(logits, None, Routing(2, renormalise=True))
    assert torch.equal(experts, chosen) and kernels.count == {"topk": 1, "_softmax": 1}
    torch.testing.assert_close(weights, full / full.sum(-1, keepdim=True), atol=1e-7, rtol=1e-6)
    weights, experts = softmax_top_k(logits, None, Routing(2, renormalise=False))
    assert torch.equal(experts, chosen) and torch.equal(weights, full)


class Kernels(TorchDispatchMode):
    """The operators run inside it that launch a kernel on a GPU (not views or allocations), counted by name."""

    NO_KERNEL = {"view", "slice", "unsqueeze", "squeeze", "new_empty", "empty", "reshape", "_unsafe_view"}

    def __init__(self):
        super().__init__()
        self.count = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] not in self.NO_KERNEL:
            self.count[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def test_grouped_sigmoid_routing_by_hand():
    """DeepSeek-V3's router on 4 experts in 2 groups ({0, 1}, {2, 3}), one group eligible, top 2.
    logits [2, 1, 0, -1] -> sigmoid scores [0.8808, 0.7311, 0.5, 0.2689]. The bias [0, 0, 1.2, 0] moves
    the choice only: biased scores [0.8808, 0.7311, 1.7, 0.2689], group sums of the two best 1.6119 vs
    1.9689, so group {2, 3} is chosen although expert 0 scores highest. Weights are the unbiased scores
    [0.5, 0.2689], renormalised [0.6502, 0.3498], times routed_scaling_factor 2.5: [1.6256, 0.8744]."""
    from everyprompt.rollout.native.moe import Routing, grouped_sigmoid_top_k

    routing = Routing(top_k=2, renormalise=True, groups=2, top_groups=1, scaling=2.5)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, experts = grouped_sigmoid_top_k(logits, torch.tensor([0.0, 0.0, 1.2, 0.0]), routing)
    order = experts[0].argsort()
    assert experts[0, order].tolist() == [2, 3]
    torch.testing.assert_close(weights[0, order], torch.tensor([1.6256, 0.8744]), atol=1e-4, rtol=0)
    weights, experts = grouped_sigmoid_top_k(logits, None, routing)  # no bias: group {0, 1}
    order = experts[0].argsort()
    assert experts[0, order].tolist() == [0, 1]
    # 0.8808 / (0.8808 + 0.7311) * 2.5 = 1.3661, 0.7311 / 1.6119 * 2.5 = 1.1339
    torch.testing.assert_close(weights[0, order], torch.tensor([1.3661, 1.1339]), atol=1e-4, rtol=0)


def test_recorded_routes_and_router_logits_are_the_hf_routers(tiny_model):
    """Every token fed through the engine (prompt and completion but the last) carries its top-k experts
    and the router logits they were chosen from, per MoE layer: the HF router's logits in fp32, through
    slot refills and pool shrinking."""
    model, tokenizer = tiny_model
    engine = NativeEngine.from_model(model, tokenizer, batch_size=3)
    params = SamplingParams(12, record_routes=True, record_router_logits=True)
    completions = list(engine.generate(_requests(tokenizer, PROMPTS * 2), params))
    assert len(completions) == 2 * len(PROMPTS)
    top_k, experts = model.config.num_experts_per_tok, model.config.num_experts
    for completion in completions:
        ids = completion.prompt_ids + completion.token_ids
        logits = completion.router_logits
        assert logits.dtype == torch.float32
        assert logits.shape == (len(ids) - 1, model.config.num_hidden_layers, experts)
        with torch.no_grad():
            reference = model(input_ids=torch.tensor([ids]), output_router_logits=True).router_logits
        for layer, expected in enumerate(reference):
            torch.testing.assert_close(
                logits[:, layer], expected[: len(ids) - 1].float(), atol=1e-5, rtol=1e-5
            )
        routes = completion.routed_experts
        assert routes.dtype == torch.int16 and routes.shape == (len(ids) - 1, logits.shape[1], top_k)
        top = torch.topk(logits, top_k, dim=-1).indices.sort(-1).values
        assert torch.equal(top, routes.long().sort(-1).values)


def test_router_logits_alone_are_recorded_without_routes(tiny_model):
    engine = NativeEngine.from_model(*tiny_model)
    [completion] = engine.generate(
        _requests(tiny_model[1], PROMPTS[:1]), SamplingParams(4, record_router_logits=True)
    )
    assert completion.routed_experts is None
    assert completion.router_logits.shape[0] == len(completion.prompt_ids) + len(completion.token_ids) - 1


def test_batched_and_grouped_expert_paths_agree(tiny_model, monkeypatch):
    """Decode steps and short prefills run the experts batched over padded row blocks, or (large experts
    on the CPU) as grouped matmuls, long prefills one expert at a time: same completions."""
    import everyprompt.rollout.native.moe as moe

    model, tokenizer = tiny_model
    requests = _requests(tokenizer, PROMPTS * 3)
    params = SamplingParams(12, record_routes=True)
    dense = NativeEngine.from_model(model, tokenizer)
    one_at_a_time = NativeEngine.from_model(model, tokenizer)
    one_at_a_time.moe.batched_tokens = 0  # never batched
    by_id = {c.request_id: c for c in one_at_a_time.generate(requests, params)}
    monkeypatch.setattr(moe, "GROUPED_EXPERT_BYTES", 1)  # every expert counts as large: grouped matmuls
    grouped = NativeEngine.from_model(model, tokenizer, compile="off")
    grouped_by_id = {c.request_id: c for c in grouped.generate(requests, params)}
    for completion in dense.generate(requests, params):
        for reference in (by_id[completion.request_id], grouped_by_id[completion.request_id]):
            assert completion.token_ids == reference.token_ids
            torch.testing.assert_close(completion.logprobs, reference.logprobs, atol=1e-5, rtol=0)
            assert torch.equal(completion.routed_experts, reference.routed_experts)


@pytest.mark.parametrize("flag", ["record_routes", "record_router_logits"])
def test_recording_routes_of_a_dense_model_is_a_clear_error(tiny_model, flag):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.conftest import TINY_LAYERS

    tokenizer = tiny_model[1]
    config = Qwen3Config(vocab_size=len(tokenizer), intermediate_size=32, **TINY_LAYERS)
    engine = NativeEngine.from_model(Qwen3ForCausalLM(config).eval(), tokenizer)
    with pytest.raises(UnsupportedModelError, match=f"{flag} needs a mixture-of-experts model"):
        list(engine.generate(_requests(tokenizer, PROMPTS[:1]), SamplingParams(4, **{flag: True})))


def test_experts_too_large_for_the_cpu_caches_run_grouped(tiny_model, monkeypatch):
    """The CPU decodes experts of 1 MiB or more as grouped matmuls (only the chosen ones' weights are
    read; one at a time where torch has no grouped_mm); small ones, as the tiny demo model's, stay
    batched; long prefills run one expert at a time whatever the size."""
    import everyprompt.rollout.native.moe as moe
    from everyprompt.rollout.native.families import FAMILIES
    from everyprompt.rollout.native.moe import GROUPED_EXPERT_BYTES, MixtureOfExperts

    model, _ = tiny_model
    layer = MixtureOfExperts(model.config, FAMILIES[model.config.model_type])
    flat = torch.zeros(4, 32)
    small = (torch.zeros(8, 32, 64), torch.zeros(8, 32, 32))
    hidden, inner = (
        256,
        GROUPED_EXPERT_BYTES // 4 // (3 * 256) + 3,
    )  # just over 1 MiB of fp32, 344 = 16-byte rows
    large = (torch.zeros(8, hidden, 2 * inner), torch.zeros(8, inner, hidden))
    odd = (torch.zeros(8, hidden, 2 * inner + 2), torch.zeros(8, inner + 1, hidden))  # rows of 1380 bytes
    assert moe.GROUPED_MM  # the torch this project tests with has it
    assert layer._path(flat, *small) is moe.experts_batched
    assert layer._path(flat, *large) is moe.experts_routed
    assert layer._path(torch.zeros(layer.batched_tokens + 1, 32), *small) is moe.experts_grouped
    # an accelerator without grouped matmuls for them (a meta tensor stands in): batched, and a long prefill
    # one expert at a time
    assert layer._path(flat.to("meta"), *large) is moe.experts_batched
    assert (
        layer._path(torch.zeros(layer.batched_tokens + 1, 32, device="meta"), *small) is moe.experts_grouped
    )
    calls = []
    for name in ("experts_grouped_mm", "experts_grouped"):
        monkeypatch.setattr(moe, name, lambda *a, name=name: calls.append(name))
    moe.experts_routed(*large, flat, None, None)
    moe.experts_routed(*odd, flat, None, None)  # grouped_mm wants 16-byte strides
    shifted = torch.zeros(8 * hidden * 2 * inner + 1)[1:].view(8, hidden, 2 * inner)  # starts 4 bytes in
    moe.experts_routed(shifted, large[1], flat, None, None)
    monkeypatch.setattr(moe, "GROUPED_MM", False)
    moe.experts_routed(*large, flat, None, None)
    assert calls == ["experts_grouped_mm", "experts_grouped", "experts_grouped", "experts_grouped"]


def _grouped_mm_by_counting(gate_up, down, flat, weights, experts):
    """The grouped-matmul experts as first written (counts scattered and summed, the permutation inverted
    by a sort): the reference the shorter form must equal bit for bit."""
    import torch.nn.functional as F

    from everyprompt.rollout.native.moe import _by_expert

    tokens, top_k = experts.shape
    order, counts = _by_expert(experts, down.shape[0])
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    hidden = F.grouped_mm(flat[order // top_k], gate_up, offs=ends)
    inner = down.shape[1]
    out = F.grouped_mm(F.silu(hidden[:, :inner]) * hidden[:, inner:], down, offs=ends)
    out = out[torch.argsort(order)].view(tokens, top_k, -1)
    return (out.float() * weights.float()[..., None]).sum(1).to(out.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_expert_matmuls_equal_their_first_form_in_fewer_kernels(dtype):
    """What a CUDA device runs for bf16 experts (`experts_grouped_mm`, here on the CPU's grouped_mm): the
    first form's outputs, an expert without tokens included (bf16 bit for bit; float32 within a rounding:
    the weighted sum is one batched product's fused multiply-adds), with 7 fewer kernels in bf16 (each
    operator that is not a view or an allocation launches one on a GPU)."""
    from everyprompt.rollout.native.moe import experts_grouped_mm

    generator = torch.Generator().manual_seed(0)
    gate_up = torch.randn(8, 64, 64, generator=generator).to(dtype)
    down = torch.randn(8, 32, 64, generator=generator).to(dtype)
    flat = torch.randn(16, 64, generator=generator).to(dtype)
    logits = torch.randn(16, 8, generator=generator)
    logits[:, 5] = -1e9  # expert 5 gets no token
    weights, experts = torch.topk(torch.softmax(logits, -1), 2)
    weights = weights.to(dtype)
    counted = []
    for function in (_grouped_mm_by_counting, experts_grouped_mm):
        with Kernels() as kernels:
            out = function(gate_up, down, flat, weights, experts)
        counted.append((out, sum(kernels.count.values())))
    (expected, before), (got, after) = counted
    if dtype == torch.bfloat16:
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-6)
    # 11: sort, arange, searchsorted, the rows' index and gather, two grouped matmuls, SiLU and its product,
    # the scatter back and the weighted sum (bf16's casts to and from float32 gone: 7 fewer, float32's 4)
    assert (before - after, after) == ({torch.bfloat16: 7, torch.float32: 4}[dtype], 11), (before, after)
