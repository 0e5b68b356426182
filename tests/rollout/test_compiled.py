"""The compiled decode step (rollout.compile): the same samples as the eager one, the switch rule of
`auto`, and the refusals. The compiled tests are in the slow set: a cold inductor cache (a fresh
machine, as CI's) compiles for about two minutes on 2 cores; a warm one in about ten seconds."""

import pytest
import torch

from everyprompt.rollout import GenerationRequest, SamplingParams, UnsupportedModelError, make_engine
from everyprompt.rollout.native import NativeEngine
from everyprompt.rollout.native.compiled import DecodeCompiler
from tests.conftest import make_tiny_model

PROMPTS = ["37+48=", "1+2=", "123+456+789=", "9=", "5+5+5=", "800+1="]


def _requests(tokenizer, prompts=PROMPTS, seed=0):
    return [GenerationRequest(i, tokenizer(p).input_ids, seed=seed + i) for i, p in enumerate(prompts)]


def _by_id(completions):
    return {c.request_id: c for c in completions}


@pytest.fixture(scope="module")
def tiny_model():
    return make_tiny_model()


@pytest.fixture(scope="module")
def compiled_engine(tiny_model):
    """One compiled engine for the module: its graphs compile once (inductor's disk cache keeps them)."""
    model, tokenizer = tiny_model
    return NativeEngine.from_model(model, tokenizer, batch_size=4, compile="on")


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(20, record_routes=True),
        SamplingParams(20, temperature=0.7, top_p=0.9),
        SamplingParams(12, greedy=True),
    ],
    ids=["sampled-routes", "top-p", "greedy"],
)
def test_compiled_and_eager_engines_give_the_same_samples(tiny_model, compiled_engine, params):
    model, tokenizer = tiny_model
    eager = NativeEngine.from_model(model, tokenizer, batch_size=4)
    # six requests through four slots: admissions into freed slots and a shrinking pool, both compiled
    expected = _by_id(eager.generate(_requests(tokenizer), params))
    got = _by_id(compiled_engine.generate(_requests(tokenizer), params))
    assert compiled_engine.stats["compiled"] == 1.0 and eager.stats["compiled"] == 0.0
    assert expected.keys() == got.keys() == set(range(len(PROMPTS)))
    for request_id, reference in expected.items():
        completion = got[request_id]
        assert completion.token_ids == reference.token_ids
        assert completion.finish_reason == reference.finish_reason
        torch.testing.assert_close(completion.logprobs, reference.logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(completion.entropies, reference.entropies, atol=1e-5, rtol=0)
        if params.record_routes:
            assert torch.equal(completion.routed_experts, reference.routed_experts)


@pytest.mark.slow
def test_compiled_continuous_batching_equals_one_at_a_time(tiny_model, compiled_engine):
    model, tokenizer = tiny_model
    params = SamplingParams(16)
    together = _by_id(compiled_engine.generate(_requests(tokenizer), params))
    for request in _requests(tokenizer):
        (alone,) = compiled_engine.generate([request], params)
        assert alone.token_ids == together[request.request_id].token_ids
        torch.testing.assert_close(alone.logprobs, together[request.request_id].logprobs, atol=1e-5, rtol=0)


def test_auto_compiles_once_eager_decoding_has_cost_the_threshold():
    compiler = DecodeCompiler("auto", auto_after_s=1.0)
    assert not compiler.active
    compiler.add_eager(0.6)
    assert not compiler.active
    compiler.add_eager(0.5)
    assert compiler.active
    assert not DecodeCompiler("off").active and DecodeCompiler("on").active


def test_auto_stays_eager_on_a_short_run(tiny_model):
    model, tokenizer = tiny_model
    engine = NativeEngine.from_model(model, tokenizer, batch_size=4, compile="auto")
    list(engine.generate(_requests(tokenizer), SamplingParams(8)))
    assert engine.stats["compiled"] == 0.0 and engine.compiler.eager_s > 0


def test_bad_compile_modes_are_refused(tiny_model):
    model, tokenizer = tiny_model
    with pytest.raises(ValueError, match="rollout.compile must be one of auto, on, off, got 'fast'"):
        NativeEngine.from_model(model, tokenizer, compile="fast")
    with pytest.raises(UnsupportedModelError, match="rollout.compile=on compiles the native engine"):
        make_engine("hf", model, tokenizer, batch_size=2, compile="on")
    assert make_engine("hf", model, tokenizer, batch_size=2, compile="auto") is not None


@pytest.mark.slow
def test_an_asynchronous_run_decodes_compiled_in_its_rollout_thread(tmp_path):
    """The compiled step runs in the rollout thread of an asynchronous run (and its weight syncs reuse the
    graph: same shapes), and the run's evaluations too."""
    import json

    from everyprompt.pipeline import train
    from tests.conftest import tiny_config

    overrides = ["rl.steps=3", "rl.max_staleness=1", "rl.old_logprobs=recompute", "rollout.compile=on"]
    train(tiny_config(*overrides, "rl.rollout_correction.mode=tis"), run_dir=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [row["rollout/compiled"] for row in rows] == [1.0, 1.0, 1.0]


def test_the_compile_setting_reads_yaml_switches_and_names_bad_values():
    from everyprompt.config import ConfigError
    from tests.conftest import tiny_config

    assert tiny_config("rollout.compile=on").rollout.compile == "on"  # YAML's boolean `on`
    assert tiny_config("rollout.compile=off").rollout.compile == "off"
    assert tiny_config().rollout.compile == "auto"
    with pytest.raises(ConfigError, match=r"rollout\.compile.*'auto', 'on' or 'off'.*fast"):
        tiny_config("rollout.compile=fast")


def test_the_ray_engine_reports_a_compiled_worker_and_the_step_logs_it():
    from everyprompt.distributed.rollout import RayEngine
    from everyprompt.trainer.rollout_side.tally import StepTally

    calls = [
        {"tokens": 10.0, "decode_steps": 5.0, "slot_occupancy": 1.0, "decode_step_ms": 2.0, "compiled": 1.0},
        {"tokens": 6.0, "decode_steps": 3.0, "slot_occupancy": 0.5, "decode_step_ms": 4.0, "compiled": 0.0},
    ]
    merged = RayEngine._merge(calls, wall=1.0, restarts=0)
    assert merged["compiled"] == 1.0 and merged["tokens"] == 16.0
    assert RayEngine._merge(calls[1:], wall=1.0, restarts=0)["compiled"] == 0.0
    tally = StepTally()
    tally.engine_calls.append(merged)
    assert tally.metrics()["rollout/compiled"] == 1.0


def _failing_compile(fn, **_):
    def compiled(*args):
        raise RuntimeError("inductor cannot lower this graph\nmore detail")

    return compiled


def test_auto_gives_up_a_failing_compile_with_a_warning_and_decodes_eager(tiny_model, monkeypatch, caplog):
    model, tokenizer = tiny_model
    params = SamplingParams(10, record_routes=True)
    expected = _by_id(
        NativeEngine.from_model(model, tokenizer, batch_size=4).generate(_requests(tokenizer), params)
    )
    monkeypatch.setattr(torch, "compile", _failing_compile)
    engine = NativeEngine.from_model(model, tokenizer, batch_size=4, compile="auto")
    engine.compiler.auto_after_s = 0.0  # compile at once
    with caplog.at_level("WARNING"):
        got = _by_id(engine.generate(_requests(tokenizer), params))
    assert "compiling the decode step failed (RuntimeError: inductor cannot lower this graph)" in caplog.text
    assert engine.stats["compiled"] == 0.0 and engine.stats["compile_failed"] == 1.0
    for request_id, reference in expected.items():
        assert got[request_id].token_ids == reference.token_ids
        torch.testing.assert_close(got[request_id].logprobs, reference.logprobs, atol=1e-5, rtol=0)
    list(engine.generate(_requests(tokenizer), params))  # later calls stay eager, without a retry
    assert engine.stats["compiled"] == 0.0 and caplog.text.count("compiling the decode step failed") == 1


def test_on_stops_at_a_failing_compile(tiny_model, monkeypatch):
    model, tokenizer = tiny_model
    monkeypatch.setattr(torch, "compile", _failing_compile)
    engine = NativeEngine.from_model(model, tokenizer, batch_size=4, compile="on")
    with pytest.raises(RuntimeError, match="inductor cannot lower this graph"):
        list(engine.generate(_requests(tokenizer), SamplingParams(4)))


def test_the_static_steps_failing_compile_is_given_up_with_a_warning(tiny_model, monkeypatch, caplog):
    """compile=on with the static step (fused bodies, captured on a GPU): a compile that fails costs the
    speed, not the run: one warning, `compile_failed`, and the eager static step's samples."""
    model, tokenizer = tiny_model
    params = SamplingParams(8, record_routes=True)
    expected = _by_id(
        NativeEngine.from_model(model, tokenizer, 4, cuda_graphs="static").generate(
            _requests(tokenizer), params
        )
    )
    monkeypatch.setattr(torch, "compile", _failing_compile)
    engine = NativeEngine.from_model(model, tokenizer, 4, cuda_graphs="static", compile="on")
    with caplog.at_level("WARNING"):
        got = _by_id(engine.generate(_requests(tokenizer), params))
        list(engine.generate(_requests(tokenizer), params))
    assert caplog.text.count("rollout.compile=on: compiling the decode step failed") == 1
    assert engine.stats["compile_failed"] == 1.0 and engine.stats["compiled"] == 0.0
    for request_id, reference in expected.items():
        assert got[request_id].token_ids == reference.token_ids
    from everyprompt.trainer.rollout_side.tally import StepTally

    tally = StepTally()
    tally.engine_calls.append(dict(engine.stats))
    assert tally.metrics()["rollout/compile_failed"] == 1.0  # the step's metrics say so too


@pytest.mark.slow
def test_a_compiled_step_runs_large_experts_over_their_own_tokens(tiny_model, monkeypatch):
    """Experts large enough to run over their own tokens on the CPU stay one opaque operator in the
    compiled step (everyprompt::routed_experts): its grouped matmuls (which read only the routed experts)
    run at every layer of every compiled step, and the samples equal the eager engine's."""
    import everyprompt.rollout.native.moe as moe

    model, tokenizer = tiny_model
    monkeypatch.setattr(moe, "GROUPED_EXPERT_BYTES", 1)  # the tiny model's experts count as large
    calls = []
    grouped = moe.experts_grouped_mm
    monkeypatch.setattr(moe, "experts_grouped_mm", lambda *a: calls.append(1) or grouped(*a))
    params = SamplingParams(12, record_routes=True)
    eager = _by_id(
        NativeEngine.from_model(model, tokenizer, batch_size=4).generate(_requests(tokenizer), params)
    )
    compiled = NativeEngine.from_model(model, tokenizer, batch_size=4, compile="on")
    calls.clear()
    got = _by_id(compiled.generate(_requests(tokenizer), params))
    assert compiled.stats["compiled"] == 1.0
    layers = sum(layer.router is not None for layer in compiled.layers)
    assert len(calls) >= layers * 11  # every layer of every decode step (prefills too)
    for request_id, reference in eager.items():
        assert got[request_id].token_ids == reference.token_ids
        torch.testing.assert_close(got[request_id].logprobs, reference.logprobs, atol=1e-5, rtol=0)
        assert torch.equal(got[request_id].routed_experts, reference.routed_experts)


@pytest.mark.slow
def test_a_compiled_step_on_an_accelerator_chooses_its_experts_path_as_it_runs(tiny_model, monkeypatch):
    """On an accelerator whether the experts run as grouped matmuls hangs on the weights' addresses and on
    a kernel tried on the device, which torch.compile cannot trace (torch 2.13 refuses to trace an
    address: the compiled step of a bf16 MoE model on CUDA was given up). Here the CPU plays the accelerator (`_accelerated`), with
    the address check on the way: the compile goes through, every layer's experts choose their path as
    they run (one opaque operator), and the samples are the eager engine's."""
    import everyprompt.rollout.native.moe as moe

    model, tokenizer = tiny_model
    monkeypatch.setattr(moe, "_accelerated", lambda flat: True)
    asked = []

    def grouped_on_device(flat, gate_up, down):
        asked.append(moe._aligned(gate_up, down))  # the weights' addresses, read as on CUDA
        return True

    monkeypatch.setattr(moe, "_grouped_on_device", grouped_on_device)
    params = SamplingParams(12, record_routes=True)
    eager = _by_id(NativeEngine.from_model(model, tokenizer, 4).generate(_requests(tokenizer), params))
    compiled = NativeEngine.from_model(model, tokenizer, 4, compile="on")
    asked.clear()
    got = _by_id(compiled.generate(_requests(tokenizer), params))
    assert compiled.stats["compiled"] == 1.0
    layers = sum(layer.router is not None for layer in compiled.layers)
    assert len(asked) >= layers * 11 and all(asked)  # every layer of every decode step, as it ran
    for request_id, reference in eager.items():
        assert got[request_id].token_ids == reference.token_ids, request_id
        torch.testing.assert_close(got[request_id].logprobs, reference.logprobs, atol=1e-5, rtol=0)
        assert torch.equal(got[request_id].routed_experts, reference.routed_experts)


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(16, record_routes=True, record_router_logits=True),
        SamplingParams(12, temperature=0.7, top_p=0.9),
    ],
    ids=["sampled-routes", "top-p"],
)
def test_the_static_steps_compiled_bodies_give_the_eager_static_steps_samples(tiny_model, params):
    """`compile=on` with the static step (what a CUDA device captures: Inductor's fused kernels inside the
    graph), here run without capture: the eager static step's tokens, log-probs and routes."""
    model, tokenizer = tiny_model
    eager = NativeEngine.from_model(model, tokenizer, batch_size=4, cuda_graphs="static")
    compiled = NativeEngine.from_model(model, tokenizer, batch_size=4, cuda_graphs="static", compile="on")
    assert compiled.decoding.name == "compiled static" and eager.decoding.name == "static"
    expected = _by_id(eager.generate(_requests(tokenizer), params))
    for _ in range(2):  # the second call reuses the compiled bodies, buffers and cache
        got = _by_id(compiled.generate(_requests(tokenizer), params))
        assert compiled.stats["compiled"] == 1.0 and compiled.stats["static_step"] == 1.0
        assert got.keys() == expected.keys()
        for request_id, reference in expected.items():
            completion = got[request_id]
            assert completion.token_ids == reference.token_ids, request_id
            torch.testing.assert_close(completion.logprobs, reference.logprobs, atol=1e-5, rtol=0)
            if params.record_routes:
                assert torch.equal(completion.routed_experts, reference.routed_experts)
                torch.testing.assert_close(
                    completion.router_logits, reference.router_logits, atol=1e-5, rtol=0
                )


@pytest.mark.long  # 16 s on 2 cores: `make test-long`
def test_a_resumed_run_keeps_the_compile_switch_of_the_run_it_continues(tmp_path, monkeypatch):
    """`auto` switches on time spent, and compiled log-probs differ from eager ones in the last bits: a run
    resumed after the switch must decode compiled from its first step, as the run it continues did, or its
    updates drift from the uninterrupted run's. Each eager decode step counts 1 s here, so the switch falls
    on the same step in every run (step 3 of 4)."""
    import json

    from everyprompt.pipeline import train
    from everyprompt.rollout.native import compiled
    from tests.conftest import tiny_config

    monkeypatch.setattr(
        compiled.DecodeCompiler, "add_eager", lambda self, s: setattr(self, "eager_s", self.eager_s + 1)
    )
    monkeypatch.setattr(compiled, "AUTO_AFTER_S", 20.0)

    def steps(run_dir):
        lines = (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
        return {r["step"]: r for r in lines if "step" in r and "actor/grad_norm" in r}

    config = ["rollout.compile=auto"]
    train(tiny_config("rl.steps=4", *config), run_dir=tmp_path / "straight")
    train(tiny_config("rl.steps=2", *config), run_dir=tmp_path / "split")
    train(tiny_config("rl.steps=4", *config), run_dir=tmp_path / "split", resume=True)
    straight, split = steps(tmp_path / "straight"), steps(tmp_path / "split")
    assert [straight[s]["rollout/compiled"] for s in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 1.0]
    assert [split[s]["rollout/compiled"] for s in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 1.0]
    for key in ("mismatch/logp_abs_diff", "actor/grad_norm", "loss/policy"):
        assert [split[s][key] for s in (3, 4)] == [straight[s][key] for s in (3, 4)], key


def test_the_compile_state_is_restored_only_under_the_same_mode():
    compiler = DecodeCompiler("auto", auto_after_s=1.0)
    compiler.add_eager(0.4)
    assert compiler.state_dict() == {"mode": "auto", "eager_s": 0.4, "compiled": False, "failure": None}
    later = DecodeCompiler("auto", auto_after_s=1.0)
    later.load_state_dict(compiler.state_dict())
    assert later.eager_s == 0.4 and not later.active
    later.load_state_dict({"mode": "auto", "eager_s": 130.0, "compiled": True, "failure": None})
    assert later.active and later.state_dict()["compiled"]  # compiles at its next call
    given_up = DecodeCompiler("auto")
    given_up.load_state_dict({"mode": "auto", "eager_s": 130.0, "compiled": True, "failure": "TypeError: x"})
    assert not given_up.active and given_up.failure == "TypeError: x"  # stays eager, as the run did
    other = DecodeCompiler("off")
    other.load_state_dict({"mode": "auto", "eager_s": 130.0, "compiled": True, "failure": None})
    assert not other.active and other.eager_s == 0.0  # the resume's own setting decides


def test_a_decode_state_is_restored_only_into_an_engine_of_its_class(tiny_model):
    """A run on Ray rollout workers resumed on one local engine (and back): the compile switch starts
    afresh; an engine of the writer's class continues it."""
    from everyprompt.rollout import restore_decode_state, saved_decode_state

    model, tokenizer = tiny_model
    writer = NativeEngine.from_model(model, tokenizer, batch_size=2, compile="auto")
    writer.compiler.add_eager(5.0)
    saved = saved_decode_state(writer)
    assert saved["engine"] == "NativeEngine" and saved["state"]["compile"]["eager_s"] == 5.0
    engine = NativeEngine.from_model(model, tokenizer, batch_size=2, compile="auto")
    restore_decode_state(engine, {**saved, "engine": "RayEngine"})
    assert engine.compiler.eager_s == 0.0
    restore_decode_state(engine, saved)
    assert engine.compiler.eager_s == 5.0
    restore_decode_state(engine, None)  # a checkpoint of an engine that offers none
    assert engine.compiler.eager_s == 5.0
