import pytest
import torch

from everyprompt.rollout import GenerationRequest, SamplingParams, UnsupportedModelError
from everyprompt.rollout.native import NativeEngine


def _requests(tokenizer, prompts, seed=0):
    return [GenerationRequest(i, tokenizer(p).input_ids, seed=seed + i) for i, p in enumerate(prompts)]


def _hf_logprobs(model, completion, temperature=1.0, entropy=False):
    ids = torch.tensor([completion.prompt_ids + completion.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    start = len(completion.prompt_ids) - 1
    targets = torch.tensor(completion.token_ids)
    logprobs = torch.log_softmax(logits, -1)[start : start + len(targets)]
    if entropy:
        return -(logprobs.exp() * logprobs).sum(-1)
    return logprobs.gather(-1, targets[:, None]).squeeze(-1)


PROMPTS = ["37+48=", "1+2=", "123+456+789=", "9="]


def _assert_same_completion(completion, reference):
    """Tokens and recorded routes equal; log-probs and entropies within fp32 rounding."""
    assert completion.token_ids == reference.token_ids
    torch.testing.assert_close(completion.logprobs, reference.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(completion.entropies, reference.entropies, atol=1e-5, rtol=0)
    assert torch.equal(completion.routed_experts, reference.routed_experts)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_match_hf_forward(tiny_model, temperature):
    model, tokenizer = tiny_model
    engine = NativeEngine.from_model(model, tokenizer)
    completions = list(
        engine.generate(_requests(tokenizer, PROMPTS), SamplingParams(16, temperature=temperature))
    )
    assert len(completions) == len(PROMPTS)
    for completion in completions:
        reference = _hf_logprobs(model, completion, temperature)
        torch.testing.assert_close(completion.logprobs, reference, atol=1e-4, rtol=0)
        entropy = _hf_logprobs(model, completion, temperature, entropy=True)
        torch.testing.assert_close(completion.entropies, entropy, atol=1e-4, rtol=0)


def test_greedy_matches_hf_argmax(tiny_model):
    model, tokenizer = tiny_model
    engine = NativeEngine.from_model(model, tokenizer)
    for completion in engine.generate(_requests(tokenizer, PROMPTS), SamplingParams(10, greedy=True)):
        ids = completion.prompt_ids
        for token in completion.token_ids:
            with torch.no_grad():
                expected = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            assert token == expected
            ids = ids + [token]


def test_sampling_is_reproducible_and_batch_invariant(tiny_model):
    model, tokenizer = tiny_model
    engine = NativeEngine.from_model(model, tokenizer, batch_size=3)
    params = SamplingParams(12)
    batched = {c.request_id: c.token_ids for c in engine.generate(_requests(tokenizer, PROMPTS), params)}
    again = {c.request_id: c.token_ids for c in engine.generate(_requests(tokenizer, PROMPTS), params)}
    alone = {
        r.request_id: next(iter(engine.generate([r], params))).token_ids
        for r in _requests(tokenizer, PROMPTS)
    }
    assert batched == again == alone
    other_seed = {
        c.request_id: c.token_ids for c in engine.generate(_requests(tokenizer, PROMPTS, 100), params)
    }
    assert other_seed != batched


def test_stops_at_eos_and_at_max_tokens(tiny_model):
    model, tokenizer = tiny_model
    params = SamplingParams(8, greedy=True)
    free = next(
        iter(NativeEngine.from_model(model, tokenizer).generate(_requests(tokenizer, PROMPTS[:1]), params))
    )
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    # Declare the third greedy token to be EOS: decoding must stop right there, with that token kept.
    stop = free.token_ids[2]
    engine = NativeEngine(
        model.config, model.state_dict(), eos_token_id=stop, pad_token_id=tokenizer.pad_token_id
    )
    stopped = next(iter(engine.generate(_requests(tokenizer, PROMPTS[:1]), params)))
    first = free.token_ids.index(stop)
    assert stopped.finish_reason == "eos"
    assert stopped.token_ids == free.token_ids[: first + 1]
    torch.testing.assert_close(stopped.logprobs, free.logprobs[: first + 1])


def test_load_weights_changes_the_policy(tiny_model):
    model, tokenizer = tiny_model
    engine = NativeEngine.from_model(model, tokenizer)
    params = SamplingParams(6, greedy=True)
    before = next(iter(engine.generate(_requests(tokenizer, PROMPTS[:1]), params)))
    state = {k: v * 1.5 if v.dim() == 2 else v for k, v in model.state_dict().items()}
    engine.load_weights(state)
    after = next(iter(engine.generate(_requests(tokenizer, PROMPTS[:1]), params)))
    assert not torch.allclose(before.logprobs[:1], after.logprobs[:1])
    with pytest.raises(KeyError, match="lm_head.weight|embed_tokens"):
        engine.load_weights({})


def test_a_sleeping_engine_frees_its_weights_and_cache_and_wakes_at_the_weight_sync(tiny_model):
    model, tokenizer = tiny_model
    engine, awake = NativeEngine.from_model(model, tokenizer), NativeEngine.from_model(model, tokenizer)
    params = SamplingParams(6, temperature=1.0, record_routes=True)
    requests = _requests(tokenizer, PROMPTS[:2], seed=3)
    list(engine.generate(requests, params))  # the cache's storage is kept between calls
    assert engine.cache._storage
    engine.sleep()
    assert engine.layers is None and engine.lm_head is None and not engine.cache._storage
    assert engine.can_record_routes  # read off the model, not its weights
    with pytest.raises(RuntimeError, match="sleeps"):
        next(iter(engine.generate(requests, params)))
    engine.load_weights(model.state_dict())
    woke = {c.request_id: c for c in engine.generate(requests, params)}
    for reference in awake.generate(requests, params):
        _assert_same_completion(woke[reference.request_id], reference)
    running = engine.generate(requests, params)
    next(running)
    with pytest.raises(RuntimeError, match="still open"):
        engine.sleep()
    running.close()


def test_unsupported_architecture_is_a_clear_error(tiny_model):
    model, tokenizer = tiny_model
    model.config.model_type = "gpt2"
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        NativeEngine.from_model(model, tokenizer)


def test_empty_prompt_is_rejected(tiny_model):
    engine = NativeEngine.from_model(*tiny_model)
    with pytest.raises(ValueError, match="empty prompt"):
        list(engine.generate([GenerationRequest(0, [])], SamplingParams(4)))


def test_routes_are_not_recorded_unless_asked(tiny_model):
    model, tokenizer = tiny_model
    engine = NativeEngine.from_model(model, tokenizer)
    completion = next(iter(engine.generate(_requests(tokenizer, PROMPTS[:1]), SamplingParams(4))))
    assert completion.routed_experts is None


def test_fp8_quantisation_error_stays_within_the_e4m3_bound():
    from everyprompt.rollout.native import FP8Weight

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(3, 16, 64, generator=generator) * torch.logspace(-3, 1, 16)[None, :, None]
    quantized = FP8Weight.quantize(weight)
    assert quantized.data.dtype == torch.float8_e4m3fn and quantized.scale.shape == (3, 16, 1)
    error = (quantized.dequantize() - weight).abs()
    # e4m3: 3 mantissa bits -> relative rounding error <= 2^-4 for normals; subnormals (below 2^-6 of the
    # scaled range) have a fixed step of 2^-9, half of which is the absolute bound
    bound = torch.maximum(weight.abs() * 2.0**-4, quantized.scale * 2.0**-10)
    assert bool((error <= bound * (1 + 1e-6)).all())
    assert float(error.max()) > 0  # it did quantise
    torch.testing.assert_close(quantized[1].dequantize(), quantized.dequantize()[1])


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_low_precision_engines_sample_close_to_fp32(tiny_model, precision):
    model, tokenizer = tiny_model
    reference = NativeEngine.from_model(model, tokenizer)
    engine = NativeEngine.from_model(model, tokenizer, precision=precision)
    params = SamplingParams(8, greedy=True)
    requests = _requests(tokenizer, PROMPTS)
    gaps = []
    for low, high in zip(
        sorted(engine.generate(requests, params), key=lambda c: c.request_id),
        sorted(reference.generate(requests, params), key=lambda c: c.request_id),
    ):
        n = min(len(low.token_ids), len(high.token_ids))
        gaps.append((low.logprobs[:n] - high.logprobs[:n]).abs())
    gap = float(torch.cat(gaps).mean())
    # different arithmetic, same network (the fixture's weights are sharpened, so gaps exceed FACTS.md's)
    assert 0 < gap < (0.05 if precision == "bf16" else 0.5), gap


def test_fp8_engine_equals_fp32_on_the_dequantised_weights(tiny_model):
    """Weight-only FP8: exactly the fp32 network whose projections went through e4m3 and back."""
    from everyprompt.rollout.native import FP8Weight

    model, tokenizer = tiny_model
    state = model.state_dict()
    projected = {
        k: (FP8Weight.quantize(v).dequantize() if ("proj" in k and "norm" not in k) else v)
        for k, v in state.items()
    }
    emulated = NativeEngine(model.config, projected, tokenizer.eos_token_id, tokenizer.pad_token_id)
    engine = NativeEngine.from_model(model, tokenizer, precision="fp8")
    params = SamplingParams(8)
    for a, b in zip(
        sorted(engine.generate(_requests(tokenizer, PROMPTS), params), key=lambda c: c.request_id),
        sorted(emulated.generate(_requests(tokenizer, PROMPTS), params), key=lambda c: c.request_id),
    ):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_fp8_weights_are_requantised_at_every_weight_sync(tiny_model):
    model, tokenizer = tiny_model
    engine = NativeEngine.from_model(model, tokenizer, precision="fp8")
    query = slice(0, model.config.num_attention_heads * model.config.head_dim)  # q_proj's rows of qkv
    before = engine.layers[0].attention.qkv.data.float().clone()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["model.layers.0.self_attn.q_proj.weight"] *= 2.0
    engine.load_weights(state)
    scale_ratio = engine.layers[0].attention.qkv.scale[query] / FP8Weight_scale(model)
    torch.testing.assert_close(scale_ratio, torch.full_like(scale_ratio, 2.0))
    # x2 moves the query rows' scales, not the fp8 codes; the key / value rows keep their own scales
    assert torch.equal(engine.layers[0].attention.qkv.data.float(), before)
    assert torch.equal(engine.layers[0].attention.qkv.scale[query.stop :], FP8Weight_scale(model, "k", "v"))


def FP8Weight_scale(model, *projections: str):
    from everyprompt.rollout.native import FP8Weight

    state = model.state_dict()
    weights = [state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in projections or ("q",)]
    return torch.cat([FP8Weight.quantize(w).scale for w in weights])


def test_continuous_batching_equals_one_at_a_time(tiny_model):
    """12 requests of different prompt lengths and caps through 3 slots: every freed slot is refilled
    from the queue mid-decode, the pool shrinks at the tail, and each completion (tokens, log-probs,
    entropies, routes) equals that request decoded alone with the same seed."""
    model, tokenizer = tiny_model
    prompts = [PROMPTS[i % 4] * (1 + i % 3) for i in range(12)]
    caps = [3, 17, 1, 9, 12, 2, 20, 5, 7, 14, 4, 11]
    requests = [
        GenerationRequest(i, tokenizer(p).input_ids, seed=50 + i, max_new_tokens=cap)
        for i, (p, cap) in enumerate(zip(prompts, caps))
    ]
    params = SamplingParams(20, record_routes=True)
    engine = NativeEngine.from_model(model, tokenizer, batch_size=3)
    streamed = list(engine.generate(requests, params))
    for completion in streamed:
        cap = caps[completion.request_id]
        assert len(completion.token_ids) == cap or (
            completion.finish_reason == "eos" and len(completion.token_ids) < cap
        )
    assert sum(c.finish_reason == "length" for c in streamed) >= 10  # mostly cut by their own caps
    stats = engine.stats
    assert stats["tokens"] == sum(len(c.token_ids) for c in streamed) and stats["slots"] == 3
    assert 0.5 < stats["slot_occupancy"] <= 1.0 and stats["tokens_per_s"] > 0
    assert stats["admissions"] > 4 and stats["pool_shrinks"] >= 1  # refilled mid-decode; shrank at the tail
    alone = NativeEngine.from_model(model, tokenizer, batch_size=1)
    for completion in streamed:
        reference = next(iter(alone.generate([requests[completion.request_id]], params)))
        _assert_same_completion(completion, reference)


def test_completions_stream_out_as_they_finish(tiny_model):
    model, tokenizer = tiny_model
    caps = [9, 2, 6, 1, 4]
    requests = [
        GenerationRequest(i, tokenizer(PROMPTS[i % 4]).input_ids, seed=i, max_new_tokens=cap)
        for i, cap in enumerate(caps)
    ]
    engine = NativeEngine.from_model(model, tokenizer, batch_size=8)
    order = [c.request_id for c in engine.generate(requests, SamplingParams(12))]
    assert order == [3, 1, 4, 2, 0]  # shortest first: each is yielded the step it ends


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


def test_interleaved_generate_calls_do_not_share_a_cache(tiny_model):
    model, tokenizer = tiny_model
    engine = NativeEngine.from_model(model, tokenizer, batch_size=2)
    params = SamplingParams(10)
    first = _requests(tokenizer, PROMPTS, seed=0)
    second = _requests(tokenizer, PROMPTS[::-1], seed=10)
    expected_first = {c.request_id: c.token_ids for c in engine.generate(first, params)}
    expected_second = {c.request_id: c.token_ids for c in engine.generate(second, params)}
    a, b = engine.generate(first, params), engine.generate(second, params)
    got_first, got_second = {}, {}
    for x, y in zip(a, b):  # step both iterators in turn
        got_first[x.request_id], got_second[y.request_id] = x.token_ids, y.token_ids
    for x in a:
        got_first[x.request_id] = x.token_ids
    for y in b:
        got_second[y.request_id] = y.token_ids
    assert got_first == expected_first and got_second == expected_second


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


def test_a_groups_prompt_is_prefilled_once_and_its_samples_equal_decoding_alone(tiny_model, monkeypatch):
    """3 prompts x 4 samples (a group's requests share their prompt): the prefill computes each distinct
    prompt once, and every completion (tokens, log-probs, entropies, routes) equals that request decoded
    alone with the same seed."""
    model, tokenizer = tiny_model
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[1]]
    requests = [
        GenerationRequest(4 * g + k, tokenizer(p).input_ids, seed=70 + 4 * g + k)
        for g, p in enumerate(prompts)
        for k in range(4)
    ]
    params = SamplingParams(10, record_routes=True)
    engine = NativeEngine.from_model(model, tokenizer, batch_size=12)
    prefilled: list[int] = []
    forward = engine.forward

    def counting(layers, tokens, *args, **kwargs):
        if tokens.shape[1] > 1:  # a prefill (a decode step feeds one token a row)
            prefilled.append(tokens.shape[0])
        return forward(layers, tokens, *args, **kwargs)

    monkeypatch.setattr(engine, "forward", counting)
    grouped = list(engine.generate(requests, params))
    assert prefilled == [3]  # one admission of 12 requests; 3 distinct prompts computed
    assert len({tuple(c.token_ids) for c in grouped}) > 3  # the samples of a group differ
    alone = NativeEngine.from_model(model, tokenizer, batch_size=1)
    for completion in grouped:
        reference = next(iter(alone.generate([requests[completion.request_id]], params)))
        _assert_same_completion(completion, reference)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 576), (64, 1, 576), (8, 37, 64)])
def test_a_low_precision_norm_in_one_op_equals_upcasting_normalising_and_rounding(dtype, shape):
    """The engine's RMSNorm in bf16 or fp16 is torch's op on the narrow input (float32 inside, one
    rounding): bit for bit the upcast, normalise, cast back that HF's modules do, in one kernel not three;
    the weight then scales in the narrow dtype, as theirs does."""
    import torch.nn.functional as F

    from everyprompt.rollout.native.attention import rms_norm

    torch.manual_seed(0)
    x = (torch.randn(shape) * 3).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1])).to(dtype)
    reference = F.rms_norm(x.float(), shape[-1:], eps=1e-5).to(dtype)
    assert torch.equal(rms_norm(x, None, 1e-5), reference)
    assert torch.equal(rms_norm(x, weight, 1e-5), weight * reference)
