"""The static decode step (static_step.py) and its CUDA graphs (graphs.py), checked on the CPU.

What a graph needs of the step, and what is checked here without a GPU:
- the step run eagerly (`cuda_graphs="static"`) gives the plain engine's tokens, log-probs and routes for
  the same seeds: dense, MoE, fp8, a live source's mixed settings, episodes; padded to its bucket, a step
  gives its real rows what an unpadded one does;
- inside a step nothing reads the device back and every buffer keeps its address (the fake CUDA device);
- the graphs themselves, replayed on the CPU as frozen closures, and bad settings: test_graphs.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from everyprompt.devices.fake_cuda import fake_cuda, real
from everyprompt.rollout import GenerationRequest, SamplingParams
from everyprompt.rollout.native import NativeEngine
from everyprompt.rollout.native.graphs import StepGraphs
from everyprompt.rollout.native.queue import LiveRequest, LiveRequests
from everyprompt.rollout.native.static_step import StaticStep
from everyprompt.rollout.native.step import DecodeStep
from tests.conftest import make_tiny_model
from tests.families import family_model
from tests.rollout.test_episodes import Scripted, _observation, _stop_string

PROMPTS = ["37+48=", "1+2=", "123+456+789=", "9=", "5+5+5=", "800+1="]


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model()


@pytest.fixture(scope="module")
def dense():
    return family_model("qwen3")


def _requests(tokenizer, prompts=PROMPTS, seed=0, **options):
    return [
        GenerationRequest(i, tokenizer(p).input_ids, seed=seed + i, **options) for i, p in enumerate(prompts)
    ]


def _by_id(completions):
    return {c.request_id: c for c in completions}


def _assert_same(got: dict, expected: dict, atol: float = 1e-5) -> None:
    """Tokens equal; log-probs, entropies and router logits within `atol` (bf16: its own rounding, as the
    static step attends over its whole cache width and runs its bucket's rows)."""
    assert got.keys() == expected.keys()
    for request_id, reference in expected.items():
        completion = got[request_id]
        assert completion.token_ids == reference.token_ids, request_id
        assert completion.finish_reason == reference.finish_reason
        torch.testing.assert_close(completion.logprobs, reference.logprobs, atol=atol, rtol=0)
        torch.testing.assert_close(completion.entropies, reference.entropies, atol=atol, rtol=0)
        for name in ("routed_experts", "router_logits", "completion_mask"):
            if getattr(reference, name) is None:
                assert getattr(completion, name) is None
            else:
                torch.testing.assert_close(
                    getattr(completion, name), getattr(reference, name), atol=1e-5, rtol=0
                )


def _engine(model, tokenizer, graphs: str, batch_size=4, precision="fp32", **options):
    return NativeEngine.from_model(model, tokenizer, batch_size, precision, cuda_graphs=graphs, **options)


# ------------------------------------------------------------------ the static step equals the plain one
@pytest.mark.parametrize(
    "which,precision,params",
    [
        ("dense", "fp32", SamplingParams(16)),
        ("dense", "bf16", SamplingParams(16, temperature=0.7, top_p=0.9)),
        ("moe", "fp32", SamplingParams(16, record_routes=True, record_router_logits=True)),
        ("moe", "fp8", SamplingParams(16, record_routes=True)),
        ("moe", "fp32", SamplingParams(12, greedy=True)),
    ],
    ids=["dense", "dense-bf16-top-p", "moe-routes", "moe-fp8-routes", "moe-greedy"],
)
def test_the_static_step_gives_the_plain_engines_completions(tiny, dense, which, precision, params):
    model, tokenizer = tiny if which == "moe" else dense
    # six requests through four rows: admissions into freed rows and a shrinking pool
    expected = _by_id(
        _engine(model, tokenizer, "off", precision=precision).generate(_requests(tokenizer), params)
    )
    engine = _engine(model, tokenizer, "static", precision=precision)
    got = _by_id(engine.generate(_requests(tokenizer), params))
    assert engine.stats["static_step"] == 1.0 and engine.stats["graph_eager_steps"] > 0
    check = _assert_close_in_bf16 if precision == "bf16" else _assert_same
    check(got, expected)
    # a second call on the same buffers and cache (left dirty by the first) gives the same again
    check(_by_id(engine.generate(_requests(tokenizer), params)), expected)


def _assert_close_in_bf16(got: dict, expected: dict) -> None:
    """bf16's comparison: the static step attends over its whole cache width and runs its bucket's rows, so
    its products round otherwise than the plain step's (by how much depends on the CPU's bf16 kernels: AMX
    rounds by the shape). A sampled token may then flip where two choices were within rounding (a nucleus
    boundary, a near-tie), after which the two sequences part. So: each completion equals the plain one's
    up to where they part, its log-probs there within bf16's 5e-2, and they part in at most 2 of 6 (a
    static step that computed wrongly parts in every one, at its first token)."""
    assert got.keys() == expected.keys()
    parted = 0
    for request_id, reference in expected.items():
        tokens, wanted = got[request_id].token_ids, reference.token_ids
        same = next(
            (i for i, (a, b) in enumerate(zip(tokens, wanted)) if a != b), min(len(tokens), len(wanted))
        )
        parted += tokens != wanted
        assert same > 0, request_id
        torch.testing.assert_close(
            got[request_id].logprobs[:same], reference.logprobs[:same], atol=5e-2, rtol=0
        )
    assert parted <= 2, f"{parted} of {len(expected)} completions parted from the plain step's"


def _live(tokenizer) -> LiveRequests:
    settings = [(1.0, 1.0, False), (0.7, 0.9, False), (1.0, 1.0, True), (1.3, 0.5, False), (0.5, 1.0, False)]
    live = LiveRequests(max_prompt_tokens=32)
    for number, (temperature, top_p, greedy) in enumerate(settings):
        request = GenerationRequest(0, tokenizer(PROMPTS[number]).input_ids, seed=100 + number)
        live.submit(LiveRequest(request, temperature, top_p, greedy))
    live.close()
    return live


def test_a_live_sources_mixed_settings_sample_the_same_on_the_static_step(tiny):
    model, tokenizer = tiny
    params = SamplingParams(max_new_tokens=16)
    expected = _by_id(_engine(model, tokenizer, "off", 3).generate(_live(tokenizer), params))
    got = _by_id(_engine(model, tokenizer, "static", 3).generate(_live(tokenizer), params))
    _assert_same(got, expected)


def test_episodes_decode_the_same_on_the_static_step(tiny):
    model, tokenizer = tiny
    params = SamplingParams(20, stop=(_stop_string(model, tokenizer, PROMPTS[2]),))

    def requests():
        return [
            GenerationRequest(
                10 + i, tokenizer(p).input_ids, seed=i, episode=Scripted(_observation(tokenizer, "+1"))
            )
            for i, p in enumerate(PROMPTS[:4])
        ] + _requests(tokenizer, PROMPTS[:4])

    expected = _by_id(_engine(model, tokenizer, "off", 3).generate(requests(), params))
    got = _by_id(_engine(model, tokenizer, "static", 3).generate(requests(), params))
    assert any(c.completion_mask is not None for c in got.values())  # an observation was fed
    _assert_same(got, expected)


def test_a_step_padded_to_its_bucket_gives_its_real_rows_what_an_unpadded_one_does(tiny, monkeypatch):
    model, tokenizer = tiny
    params = SamplingParams(16, record_routes=True)
    seen: list[int] = []
    decode = NativeEngine.decode

    def counting(self, layers, tokens, positions, caches, record):
        seen.append(tokens.shape[0])
        return decode(self, layers, tokens, positions, caches, record)

    monkeypatch.setattr(NativeEngine, "decode", counting)
    # five requests in eight rows: a pool of 5 padded to 8, then 4, 2, 1 as they finish
    unpadded = _engine(model, tokenizer, "static", 8, graph_buckets=list(range(1, 9)))
    expected = _by_id(unpadded.generate(_requests(tokenizer, PROMPTS[:5]), params))
    assert 5 in seen
    seen.clear()
    padded = _engine(model, tokenizer, "static", 8, graph_buckets=[1, 2, 4, 8])
    got = _by_id(padded.generate(_requests(tokenizer, PROMPTS[:5]), params))
    assert set(seen) <= {1, 2, 4, 8} and 8 in seen
    _assert_same(got, expected)


def test_the_static_step_moves_rows_only_where_its_bucket_falls(tiny, monkeypatch):
    """With nothing left to admit, a plain step moves the running rows to the front whenever a row finishes
    (its cost follows its rows); the static step runs its bucket's rows whichever are idle, so it moves them
    only where that takes it to a smaller bucket: the same bucket at every step as moving at every finished
    row gives, far fewer copies of the cache, and the same completions."""
    model, tokenizer = tiny
    prompts = [f"{a}+{b}=" for a, b in zip(range(3, 99, 6), range(90, 10, -5))]
    params = SamplingParams(40, temperature=1.2, record_routes=True)
    buckets: list[int] = []
    run = StepGraphs.run

    def watched(self, phase, key, rows, body, outputs):
        if phase == "forward":
            buckets.append(self.padded(rows))
        run(self, phase, key, rows, body, outputs)

    monkeypatch.setattr(StepGraphs, "run", watched)

    def rollout():
        buckets.clear()
        engine = _engine(model, tokenizer, "static", 16, graph_buckets=[1, 2, 4, 8, 12, 16])
        # each its own limit: rows finish one by one
        requests = [replace(r, max_new_tokens=3 + 2 * r.request_id) for r in _requests(tokenizer, prompts)]
        got = _by_id(engine.generate(requests, params))
        return got, engine.stats["pool_shrinks"], list(buckets)

    got, shrinks, steps = rollout()
    monkeypatch.setattr(StaticStep, "compacts", DecodeStep.compacts)  # at every finished row, as before
    expected, every, expected_steps = rollout()
    lengths = sorted(len(c.token_ids) for c in got.values())
    assert len(set(lengths)) > 10, lengths
    assert steps == expected_steps and set(steps) == {16, 12, 8, 4, 2, 1}, steps
    print(f"{shrinks:.0f} moves of the cache where moving at every finished row made {every:.0f}")
    assert 0 < shrinks < every / 2, (shrinks, every)
    _assert_same(got, expected)


# ------------------------------------------------------------------ fake CUDA: no syncs, fixed addresses
def _addresses(engine) -> dict[str, int]:
    step = engine._static
    out = {f"buffer {name}": real(t).data_ptr() for name, t in step.buffers.tensors().items()}
    for layer, entry in enumerate(step.caches):
        for i, tensor in enumerate(entry):
            out[f"cache {layer}.{i}"] = real(tensor).data_ptr()
    return out


@pytest.mark.long  # 19 s on 2 cores: `make test-long`
@pytest.mark.parametrize(
    "which,params",
    [
        ("dense", SamplingParams(12)),
        ("dense", SamplingParams(12, greedy=True)),
        ("moe", SamplingParams(12, record_routes=True, record_router_logits=True)),
        ("moe", SamplingParams(12, greedy=True, record_routes=True)),
    ],
    ids=["dense-sampled", "dense-greedy", "moe-sampled-routes", "moe-greedy-routes"],
)
def test_on_fake_cuda_a_static_step_reads_nothing_back_and_keeps_every_address(
    tiny, dense, monkeypatch, which, params
):
    model, tokenizer = tiny if which == "moe" else dense
    inside: list[int] = []  # host syncs made inside each phase's body
    addresses: list[dict[str, int]] = []
    run = StepGraphs.run

    with fake_cuda() as check:

        def watched(self, phase, key, rows, body, outputs):
            def counted(size):
                before = check.total_syncs
                body(size)
                inside.append(check.total_syncs - before)
                addresses.append(_addresses(engine))

            run(self, phase, key, rows, counted, outputs)

        monkeypatch.setattr(StepGraphs, "run", watched)
        engine = NativeEngine.from_model(model, tokenizer, 4, device="cuda:0")  # it moves the weights
        assert engine.static  # auto on a CUDA device: the static step (no real CUDA here: run eagerly)
        for _ in range(2):  # two calls: the second reuses the buffers and the cache
            completions = list(engine.generate(_requests(tokenizer), params))
    assert len(completions) == len(PROMPTS) and len(inside) > 20
    assert inside == [0] * len(inside), check.syncs
    assert all(a == addresses[0] for a in addresses)
