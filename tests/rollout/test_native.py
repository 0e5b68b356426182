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
    # different arithmetic, same network (the fixture's weights are sharpened, so gaps exceed a real model's)
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


@pytest.mark.parametrize("params", [SamplingParams(12), SamplingParams(12, record_routes=True)])
def test_a_value_sent_into_a_generate_call_is_ignored(tiny_model, params):
    """A generator's caller may `send` values (a Ray rollout worker's generator task does): the completions
    come out as they do for `next`."""
    model, tokenizer = tiny_model
    prompts = ["1+2=", "37+48=", "9="]
    expected = list(
        NativeEngine.from_model(model, tokenizer, 2).generate(_requests(tokenizer, prompts), params)
    )
    stream = NativeEngine.from_model(model, tokenizer, 2).generate(_requests(tokenizer, prompts), params)
    got = [next(stream)]
    for _ in range(len(prompts) - 1):
        got.append(stream.send("a value"))
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
