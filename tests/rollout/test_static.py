"""The static decode step (static_step.py) and its CUDA graphs (graphs.py), checked on the CPU.

What a graph needs of the step, and what is checked here without a GPU:
- the step run eagerly (`cuda_graphs="static"`) gives the plain engine's tokens, log-probs and routes for
  the same seeds: dense, MoE, fp8, a live source's mixed settings, episodes; padded to its bucket, a step
  gives its real rows what an unpadded one does;
- inside a step nothing reads the device back and every buffer keeps its address (the fake CUDA device);
- replaying the closure a "graph" captured (Python values frozen at capture, as a real graph freezes them)
  gives the same completions, across calls and weight loads, which keep every weight's address;
- bad settings are refused by name; a failed capture is reported once and the step runs eagerly.
"""

from __future__ import annotations

import logging

import pytest
import torch

from everyprompt.choices import check_buckets
from everyprompt.devices.fake_cuda import fake_cuda, real
from everyprompt.models.lora import merged_state_dict
from everyprompt.rollout import GenerationRequest, SamplingParams, UnsupportedModelError, make_engine
from everyprompt.rollout.native import NativeEngine
from everyprompt.rollout.native.graphs import StepGraphs
from everyprompt.rollout.native.queue import LiveRequest, LiveRequests
from everyprompt.rollout.native.trust import Output
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


# ------------------------------------------------------------------ fake CUDA: no syncs, fixed addresses
def _addresses(engine) -> dict[str, int]:
    step = engine._static
    out = {f"buffer {name}": real(t).data_ptr() for name, t in step.buffers.tensors().items()}
    for layer, entry in enumerate(step.caches):
        for i, tensor in enumerate(entry):
            out[f"cache {layer}.{i}"] = real(tensor).data_ptr()
    return out


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


# ------------------------------------------------------------------ graphs: frozen closures, weight loads
class ReplayedClosure:
    """A stand-in for a CUDA graph: it keeps the body and size it was captured with and replays exactly
    those (a real graph freezes every Python value the body computed at capture)."""

    def __init__(self, body, size):
        self.body, self.size = body, size

    def replay(self):
        self.body(self.size)


@pytest.fixture
def replayed(monkeypatch):
    captured: list[tuple[str, int]] = []

    def capture(self, phase, size, body, outputs):
        body(size)  # the warm-up (its outputs are this step's, as the real capture's first replay writes)
        captured.append((phase, size))
        self._call["captures"] += 1
        return ReplayedClosure(body, size)

    monkeypatch.setattr(StepGraphs, "_capture", capture)
    return captured


def test_replayed_captures_give_the_plain_engines_completions_across_calls_and_weight_loads(tiny, replayed):
    model, tokenizer = tiny
    params = SamplingParams(16, record_routes=True)
    expected = _by_id(_engine(model, tokenizer, "off").generate(_requests(tokenizer), params))
    engine = _engine(model, tokenizer, "static")
    engine.graphs.capture = True  # as on a GPU
    _assert_same(_by_id(engine.generate(_requests(tokenizer), params)), expected)
    first = list(replayed)
    assert engine.stats["graph_replays"] > 0 and engine.stats["graph_captures"] == len(first)
    assert {size for _, size in first} <= {1, 2, 4} and {phase for phase, _ in first} == {"sample", "forward"}
    _assert_same(_by_id(engine.generate(_requests(tokenizer), params)), expected)
    assert engine.stats["graph_captures"] == 0  # kept across calls

    # a weight sync copies into the held storage: the graphs stay valid and see the new weights
    other, _ = make_tiny_model()
    with torch.no_grad():
        for param in other.parameters():
            param.mul_(1.5)
    engine.load_weights(merged_state_dict(other))
    expected_other = _by_id(_engine(other, tokenizer, "off").generate(_requests(tokenizer), params))
    _assert_same(_by_id(engine.generate(_requests(tokenizer), params)), expected_other)
    assert engine.stats["graph_captures"] == 0

    engine.sleep()  # drops the storage: the graphs go with it and are captured again
    engine.load_weights(merged_state_dict(model))
    _assert_same(_by_id(engine.generate(_requests(tokenizer), params)), expected)
    assert engine.stats["graph_captures"] > 0


def _weights(engine) -> list[torch.Tensor]:
    from everyprompt.rollout.native.weights import _pair  # the walk copy_into makes

    pairs: list = []
    held = (engine.embed, engine.final_norm, engine.lm_head, engine.layers)
    assert _pair(held, held, pairs)
    return [tensor for tensor, _ in pairs]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_load_weights_keeps_every_weights_storage_and_takes_the_new_values(tiny, precision):
    model, tokenizer = tiny
    engine = _engine(model, tokenizer, "static", precision=precision)
    list(engine.generate(_requests(tokenizer), SamplingParams(4)))  # fp8: the decode layers are made
    before = [t.data_ptr() for t in _weights(engine)]
    decode_before = engine._decode_layers
    other, _ = make_tiny_model()
    with torch.no_grad():
        other.model.embed_tokens.weight.add_(1.0)
    engine.load_weights(merged_state_dict(other))
    assert [t.data_ptr() for t in _weights(engine)] == before and len(before) > 10
    assert engine._decode_layers is decode_before
    expected = other.model.embed_tokens.weight.to(engine.dtype)
    torch.testing.assert_close(engine.embed, expected, atol=0, rtol=0)


# ------------------------------------------------------------------ bad settings, failed captures
def test_buckets_must_be_increasing_positive_integers():
    assert check_buckets([1, 2, 8]) == (1, 2, 8)
    for bad in ([], [0, 2], [4, 2], [2, 2], [1.5], [True]):
        with pytest.raises(ValueError, match="expected"):
            check_buckets(bad)
    assert [StepGraphs((1, 2, 4, 8)).padded(n) for n in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, 9]


def test_engine_settings_are_refused_by_name(tiny):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match=r"graph_buckets \[4, 2\]: expected increasing"):
        _engine(model, tokenizer, "static", graph_buckets=[4, 2])
    with pytest.raises(ValueError, match="rollout.cuda_graphs must be one of auto, on, off, static"):
        _engine(model, tokenizer, "always")
    with pytest.raises(
        ValueError, match=r"cuda_graphs=on needs a CUDA device; .* \(the engine's device: cpu\)"
    ):
        _engine(model, tokenizer, "on")
    with pytest.raises(UnsupportedModelError, match="rollout.cuda_graphs=on needs a CUDA device"):
        make_engine("native", model, tokenizer, 4, cuda_graphs="on")
    with pytest.raises(UnsupportedModelError, match="the hf engine has none"):
        make_engine("hf", model, tokenizer, 4, cuda_graphs="on")


@pytest.mark.parametrize(
    "override,message",
    [
        ("rollout.graph_buckets=[4,2]", "rollout.graph_buckets': expected increasing batch sizes"),
        ("rollout.graph_buckets=[0,8]", "rollout.graph_buckets': expected a list of positive integers"),
        ("rollout.cuda_graphs=maybe", "rollout.cuda_graphs"),
    ],
)
def test_bad_graph_settings_exit_2_naming_the_key(override, message, capsys):
    from everyprompt.cli import main

    assert main(["train", "configs/demo.yaml", override]) == 2
    assert message in capsys.readouterr().err


def test_graphs_on_a_cpu_device_exit_2_naming_the_key(capsys):
    from everyprompt.cli import main

    assert main(["train", "configs/demo.yaml", "rollout.cuda_graphs=on", "rollout.device=cpu"]) == 2
    assert "rollout.cuda_graphs=on needs a CUDA device" in capsys.readouterr().err


def test_a_capture_that_fails_is_reported_once_and_the_step_runs_eagerly(tiny, caplog):
    """Capturing needs CUDA, which this machine lacks: the failure here is a real one."""
    model, tokenizer = tiny
    params = SamplingParams(12)
    expected = _by_id(_engine(model, tokenizer, "off").generate(_requests(tokenizer), params))
    engine = _engine(model, tokenizer, "static")
    engine.graphs.capture = True
    with caplog.at_level(logging.WARNING, logger="everyprompt.rollout.native.graphs"):
        _assert_same(_by_id(engine.generate(_requests(tokenizer), params)), expected)
        _assert_same(_by_id(engine.generate(_requests(tokenizer), params)), expected)
    warnings = [r.getMessage() for r in caplog.records if "capturing" in r.getMessage()]
    assert len(warnings) == 1 and "decoding without CUDA graphs" in warnings[0]
    assert engine.stats["graph_failed"] == 1.0 and engine.stats["graph_replays"] == 0
    assert engine.stats["graph_eager_steps"] > 0


def test_a_phase_is_captured_for_a_bounded_number_of_keys(replayed):
    from everyprompt.rollout.native.graphs import MAX_KEYS

    graphs = StepGraphs((1, 2, 4), capture=True)
    ran: list[int] = []
    for key in range(MAX_KEYS + 3):
        graphs.run("sample", key, 3, ran.append, lambda size: [])
        graphs.run("sample", key, 3, ran.append, lambda size: [])  # a replay for the captured keys
    assert graphs.graphs == MAX_KEYS and len(replayed) == MAX_KEYS
    # a capture is followed by its first replay (which runs the step); the keys past the bound run eagerly
    assert graphs.stats()["graph_replays"] == 2 * MAX_KEYS and graphs.stats()["graph_eager_steps"] == 6
    assert set(ran) == {4}  # every step ran its bucket's rows


def test_a_steps_metrics_add_up_its_calls_graph_figures(tiny, replayed):
    from everyprompt.trainer.tally import StepTally

    model, tokenizer = tiny
    engine = _engine(model, tokenizer, "static")
    engine.graphs.capture = True
    tally = StepTally()
    for _ in range(2):  # the first call captures, the second replays only
        list(engine.generate(_requests(tokenizer), SamplingParams(8)))
        tally.engine_calls.append(dict(engine.stats))
    metrics = tally.metrics()
    assert metrics["rollout/graph_captures"] == len(replayed) > 0
    assert metrics["rollout/graph_replays"] == sum(c["graph_replays"] for c in tally.engine_calls) > 0
    assert metrics["rollout/graph_capture_s"] == sum(c["graph_capture_s"] for c in tally.engine_calls)
    assert metrics["rollout/graph_eager_steps"] == 0 and metrics["rollout/graph_failed"] == 0
    # two calls whose capture had failed: the step says so (a flag, not a count), and adds up how many of
    # their decode steps ran eagerly
    failed = {**tally.engine_calls[-1], "graph_failed": 1.0, "graph_eager_steps": 5.0}
    tally.engine_calls += [failed, failed]
    metrics = tally.metrics()
    assert metrics["rollout/graph_failed"] == 1.0 and metrics["rollout/graph_eager_steps"] == 10.0
    plain, engine = StepTally(), _engine(model, tokenizer, "off")
    list(engine.generate(_requests(tokenizer), SamplingParams(8)))
    plain.engine_calls.append(dict(engine.stats))
    assert not any(key.startswith("rollout/graph") for key in plain.metrics())  # no static step, no figures


def test_a_graph_whose_first_replay_disagrees_with_the_eager_step_is_not_trusted(monkeypatch, caplog):
    """The capture machinery stood in for on the CPU: the body really runs (warm-up, then inside the
    'capture'), and the graph's replay writes a wrong token: the engine must not keep that graph."""
    import contextlib

    out = torch.zeros(4, dtype=torch.long)

    class Stream:
        def wait_stream(self, other):
            pass

    class WrongGraph:
        def replay(self):
            out[0] += 1  # not what the step computes

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, **options: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", WrongGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)

    def body(size):
        out[:size] = torch.arange(size)

    graphs = StepGraphs((1, 2, 4), capture=True)
    with caplog.at_level(logging.WARNING, logger="everyprompt.rollout.native.graphs"):
        graphs.run("sample", "key", 3, body, lambda size: [Output(out[:size])])
    assert graphs.failure is not None and "first replay wrote other values" in graphs.failure
    assert "output 0 (int64, [4]): 1 of 4 values differ" in graphs.failure  # the bucket of 4 rows
    assert graphs.graphs == 0 and torch.equal(out, torch.arange(4))  # the step ran eagerly after all
    assert graphs.stats()["graph_eager_steps"] == 1 and "decoding without CUDA graphs" in caplog.text

    class QuietGraph:  # its replay leaves what the step wrote: it agrees
        def replay(self):
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", QuietGraph)
    trusted = StepGraphs((1, 2, 4), capture=True)
    trusted.run("sample", "key", 3, body, lambda size: [Output(out[:size])])
    assert trusted.failure is None and trusted.graphs == 1 and trusted.stats()["graph_captures"] == 1
