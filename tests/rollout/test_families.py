"""Every model family on every engine that runs it: log-probs equal a transformers forward, continuous
batching equals one-at-a-time decoding, recorded routes equal the routers' own top-k and replay
reproduces the engine, and `everyprompt train` runs to the end on a checkpoint of the family."""

from __future__ import annotations

import json

import pytest
import torch

from everyprompt.cli import main
from everyprompt.models.replay import RouterReplay
from everyprompt.rollout import GenerationRequest, SamplingParams, engines_for, make_engine
from tests.conftest import TINY_OVERRIDES
from tests.families import EAGER_ONLY, FAMILY_CONFIGS, MOE_FAMILIES, family_model, save_family_checkpoint

FAMILIES = list(FAMILY_CONFIGS)
NATIVE = ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3"]
PROMPTS = ["37+48=", "1+2=", "123+456+789=", "9=", "5*5=", "60-7=", "2+2+2=", "8/4="]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    model, tokenizer = family_model(request.param)
    return request.param, model, tokenizer


def _requests(tokenizer, seed=0):
    return [GenerationRequest(i, tokenizer(p).input_ids, seed=seed + i) for i, p in enumerate(PROMPTS)]


def _forward(model, completion, temperature):
    """transformers' log-probs and entropies of a completion's tokens, fp32, one unpadded forward."""
    ids = torch.tensor([completion.prompt_ids + completion.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].float() / temperature
    start = len(completion.prompt_ids) - 1
    logprobs = torch.log_softmax(logits, -1)[start : start + len(completion.token_ids)]
    chosen = logprobs.gather(-1, torch.tensor(completion.token_ids)[:, None]).squeeze(-1)
    return chosen, -(logprobs.exp() * logprobs).sum(-1)


def test_auto_takes_native_where_it_runs_the_family(family):
    name, model, _ = family
    assert engines_for(model.config) == (["native", "hf"] if name in NATIVE else ["hf"])


@pytest.mark.long  # 7 s on 2 cores: `make test-long`
@pytest.mark.parametrize("engine", ["native", "hf"])
def test_engine_log_probs_equal_a_transformers_forward(family, engine):
    name, model, tokenizer = family
    if engine not in engines_for(model.config):
        pytest.skip(f"{engine} does not run {name}")
    rollout = make_engine(engine, model, tokenizer, batch_size=3)
    completions = list(rollout.generate(_requests(tokenizer), SamplingParams(12, temperature=0.8)))
    assert sorted(c.request_id for c in completions) == list(range(len(PROMPTS)))
    for completion in completions:
        logprobs, entropies = _forward(model, completion, 0.8)
        torch.testing.assert_close(completion.logprobs, logprobs, atol=1e-4, rtol=0)
        torch.testing.assert_close(completion.entropies, entropies, atol=1e-4, rtol=0)


@pytest.mark.long  # 17 s on 2 cores: `make test-long`
@pytest.mark.parametrize("engine", ["native", "hf"])
def test_continuous_batching_equals_one_at_a_time(family, engine):
    name, model, tokenizer = family
    if engine not in engines_for(model.config):
        pytest.skip(f"{engine} does not run {name}")
    params = SamplingParams(12, record_routes=name in MOE_FAMILIES)
    batched = make_engine(engine, model, tokenizer, batch_size=3)
    together = {c.request_id: c for c in batched.generate(_requests(tokenizer), params)}
    assert batched.stats["admissions"] > 1  # slots were refilled (or the batch re-formed) mid-call
    alone = make_engine(engine, model, tokenizer, batch_size=1)
    for request in _requests(tokenizer):
        single = next(iter(alone.generate([request], params)))
        mine = together[request.request_id]
        assert mine.token_ids == single.token_ids and mine.finish_reason == single.finish_reason
        torch.testing.assert_close(mine.logprobs, single.logprobs, atol=1e-5, rtol=0)
        if params.record_routes:
            assert torch.equal(mine.routed_experts, single.routed_experts)


@pytest.mark.slow
def test_the_compiled_native_engine_equals_the_eager_one(family):
    """rollout.compile on every family the native engine runs (auto, the default, compiles in long runs):
    the same tokens, log-probs within 1e-5 and the same routes."""
    name, model, tokenizer = family
    if "native" not in engines_for(model.config):
        pytest.skip(f"native does not run {name}")
    params = SamplingParams(10, temperature=0.8, record_routes=name in MOE_FAMILIES)
    eager = make_engine("native", model, tokenizer, batch_size=3, compile="off")
    compiled = make_engine("native", model, tokenizer, batch_size=3, compile="on")
    expected = {c.request_id: c for c in eager.generate(_requests(tokenizer), params)}
    got = {c.request_id: c for c in compiled.generate(_requests(tokenizer), params)}
    assert compiled.stats["compiled"] == 1.0 and got.keys() == expected.keys()
    for request_id, reference in expected.items():
        assert got[request_id].token_ids == reference.token_ids
        torch.testing.assert_close(got[request_id].logprobs, reference.logprobs, atol=1e-5, rtol=0)
        if params.record_routes:
            assert torch.equal(got[request_id].routed_experts, reference.routed_experts)


@pytest.mark.parametrize("engine", ["native", "hf"])
def test_routes_equal_the_routers_top_k_and_replay_reproduces_the_engine(family, engine):
    name, model, tokenizer = family
    if name not in MOE_FAMILIES:
        pytest.skip(f"{name} is dense")
    if engine not in engines_for(model.config):
        pytest.skip(f"{engine} does not run {name}")
    rollout = make_engine(engine, model, tokenizer, batch_size=4)
    replay = RouterReplay(model)
    for completion in rollout.generate(_requests(tokenizer, seed=5), SamplingParams(10, record_routes=True)):
        ids = torch.tensor([completion.prompt_ids + completion.token_ids])
        with torch.no_grad(), replay.record() as seen:
            model(input_ids=ids, use_cache=False)
        own = torch.stack(seen, dim=1)[:-1]  # [fed tokens, L_moe, k]: the last token is never fed
        assert completion.routed_experts.shape == own.shape
        assert torch.equal(completion.routed_experts.long().sort(-1).values, own.long().sort(-1).values)
        given = torch.cat([completion.routed_experts.long(), torch.full((1, *own.shape[1:]), -1)])
        with torch.no_grad(), replay.replay(given):
            logprobs, _ = _forward(model, completion, 1.0)
        torch.testing.assert_close(logprobs, completion.logprobs, atol=1e-4, rtol=0)


@pytest.mark.long  # 13 s on 2 cores: `make test-long`
@pytest.mark.parametrize("name", FAMILIES)
def test_train_runs_on_a_checkpoint_of_the_family(tmp_path, name, capsys):
    checkpoint = save_family_checkpoint(name, tmp_path / name)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(8))
    )
    replay = ["rl.router_replay=r3", "rl.old_logprobs=recompute"] if name in MOE_FAMILIES else []
    if name in EAGER_ONLY:  # eager attention does not restart at packed sequence boundaries (docs/models.md)
        replay.append("model.pack_sequences=false")
    run = tmp_path / "run"
    code = main(
        [
            "train",
            *TINY_OVERRIDES,
            f"model.path={checkpoint}",
            "sft.steps=0",
            "rl.steps=2",
            f"data.train_file={prompts}",
            "rewards.function=math",
            *replay,
            "--run-dir",
            str(run),
        ]
    )
    assert code == 0, capsys.readouterr().err
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    engine = "native" if name in NATIVE else "hf"
    assert f"rollout engine: {engine}" in capsys.readouterr().err  # the console reports on stderr
    if replay:  # r3: the trainer's forward took the engine's routes
        assert all(line["mismatch/routing_agreement"] == 1.0 for line in lines)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    "name, rope",
    [
        ("llama", LLAMA3_ROPE),
        ("qwen3", YARN_ROPE),
        ("mixtral", {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}),
    ],
)
def test_native_computes_scaled_rope_like_transformers(name, rope):
    model, tokenizer = family_model(name, rope_parameters=rope)
    engine = make_engine("native", model, tokenizer, batch_size=4)
    for completion in engine.generate(_requests(tokenizer), SamplingParams(12)):
        torch.testing.assert_close(
            completion.logprobs, _forward(model, completion, 1.0)[0], atol=1e-4, rtol=0
        )


@pytest.mark.parametrize(
    "overrides",
    [
        dict(q_lora_rank=None),  # one query projection instead of q_a -> norm -> q_b
        dict(rope_interleave=False),
        dict(attention_bias=True),
        # DeepSeek-V3's own rope: YaRN with mscale_all_dim, which also scales the softmax (by 1.1386^2 here)
        dict(rope_parameters={**YARN_ROPE, "mscale": 1.0, "mscale_all_dim": 1.0}),
    ],
    ids=["q_proj", "no_interleave", "attention_bias", "yarn_mscale"],
)
def test_native_latent_attention_variants_equal_transformers(overrides):
    model, tokenizer = family_model("deepseek_v3", **overrides)
    engine = make_engine("native", model, tokenizer, batch_size=3)
    for completion in engine.generate(_requests(tokenizer), SamplingParams(12, temperature=0.8)):
        torch.testing.assert_close(
            completion.logprobs, _forward(model, completion, 0.8)[0], atol=1e-4, rtol=0
        )


def test_native_latent_attention_in_fp8_is_the_dequantised_network_and_bf16_stays_close():
    from everyprompt.rollout.native import FP8Weight, NativeEngine

    model, tokenizer = family_model("deepseek_v3")
    emulated = {
        k: (FP8Weight.quantize(v).dequantize() if "proj" in k and not k.endswith("bias") else v)
        for k, v in model.state_dict().items()
    }
    plain = NativeEngine(model.config, emulated, tokenizer.eos_token_id, tokenizer.pad_token_id)
    fp8 = make_engine("native", model, tokenizer, batch_size=3, precision="fp8")
    bf16 = make_engine("native", model, tokenizer, batch_size=3, precision="bf16")
    params = SamplingParams(12)
    expected = {c.request_id: c for c in plain.generate(_requests(tokenizer), params)}
    for completion in fp8.generate(_requests(tokenizer), params):
        assert completion.token_ids == expected[completion.request_id].token_ids
        reference = expected[completion.request_id].logprobs
        torch.testing.assert_close(completion.logprobs, reference, atol=1e-5, rtol=0)
    gaps = [
        (completion.logprobs - _forward(model, completion, 1.0)[0]).abs()
        for completion in bf16.generate(_requests(tokenizer), params)
    ]
    # bf16 arithmetic, same model: 0.021 measured, as the hf engine's bf16 copy of it (0.021)
    assert float(torch.cat(gaps).mean()) < 0.04


@pytest.mark.parametrize(
    "name, overrides, setting",
    [
        (
            "llama",
            dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
            "rope_type='dynamic'",
        ),
        ("llama", dict(mlp_bias=True), "mlp_bias=True"),
        (
            "qwen2",
            dict(use_sliding_window=True, sliding_window=8, max_window_layers=0),
            "layer_types with sliding_attention",
        ),
        ("mixtral", dict(sliding_window=8), "sliding_window=8"),
        ("qwen3_moe", dict(hidden_act="gelu"), "hidden_act='gelu'"),
        ("deepseek_v3", dict(num_key_value_heads=2), "num_key_value_heads=2 != num_attention_heads=4"),
    ],
)
def test_a_setting_native_does_not_compute_is_refused_by_name(tmp_path, capsys, name, overrides, setting):
    checkpoint = save_family_checkpoint(name, tmp_path / name, **overrides)
    capsys.readouterr()
    run = tmp_path / "run"
    argv = ["train", *TINY_OVERRIDES, f"model.path={checkpoint}", "--run-dir", str(run)]
    assert main([*argv, "rollout.engine=native"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert setting in err[0] and "set rollout.engine=hf (or auto)" in err[0]
    assert not (run / "sft").exists() and not (run / "checkpoints").exists()  # refused before any training
    model, _ = family_model(name, **overrides)
    assert engines_for(model.config) == ["hf"]  # auto runs it on hf


def test_a_precision_no_engine_runs_for_the_model_is_refused_before_training(tmp_path, capsys):
    from everyprompt.rollout import UnsupportedModelError, resolve_engine

    model, _ = family_model("gpt_oss")
    with pytest.raises(UnsupportedModelError, match=r"hf: it runs rollout.precision fp32, bf16, not fp8"):
        resolve_engine("auto", model.config, "fp8")
    assert resolve_engine("auto", model.config, "bf16") == "hf"
    checkpoint = save_family_checkpoint("gpt_oss", tmp_path / "oss")
    capsys.readouterr()
    run = tmp_path / "run"
    argv = [
        "train",
        *TINY_OVERRIDES,
        f"model.path={checkpoint}",
        "rollout.precision=fp8",
        "rl.old_logprobs=recompute",
        "--run-dir",
        str(run),
    ]
    assert main(argv) == 2
    assert "no registered rollout engine can run this gpt_oss model" in capsys.readouterr().err
    assert not (run / "sft").exists()


def test_the_hf_engine_takes_a_weight_sync_one_weight_at_a_time():
    """Each weight is copied in before the next is read (a LoRA policy's merged weights are made as
    they are read, so one is in memory at a time); a weight of another shape is refused by name."""
    from collections.abc import Mapping

    model, tokenizer = family_model("mixtral")
    other, _ = family_model("mixtral", seed=7)
    engine = make_engine("hf", model, tokenizer, batch_size=4)
    held, new = engine.model.state_dict(), other.state_dict()

    class Reading(Mapping):
        """`new`, checking at each read that the weight read before it is in the engine already."""

        def __init__(self, weights):
            self.weights, self.read = weights, []

        def __getitem__(self, name):
            if self.read:
                previous = self.read[-1]
                assert torch.equal(held[previous], new[previous]), f"{previous} not copied before {name}"
            self.read.append(name)
            return self.weights[name]

        def __iter__(self):
            return iter(self.weights)

        def __len__(self):
            return len(self.weights)

        def __contains__(self, name):
            return name in self.weights

    reading = Reading(new)
    engine.load_weights(reading)
    assert len(reading.read) == len(held) and all(torch.equal(held[k], new[k]) for k in held)
    wrong = dict(new)
    wrong["lm_head.weight"] = wrong["lm_head.weight"][:1]  # would broadcast into the head, silently
    with pytest.raises(ValueError, match=r"lm_head.weight is \(1, "):
        engine.load_weights(wrong)


def test_hf_engine_weight_sync_and_bf16():
    model, tokenizer = family_model("mixtral")
    other, _ = family_model("mixtral", seed=7)
    synced = make_engine("hf", model, tokenizer, batch_size=4)
    synced.load_weights(other.state_dict())
    fresh = make_engine("hf", other, tokenizer, batch_size=4)
    params = SamplingParams(10)
    a = {c.request_id: c for c in synced.generate(_requests(tokenizer), params)}
    b = {c.request_id: c for c in fresh.generate(_requests(tokenizer), params)}
    assert all(a[i].token_ids == b[i].token_ids and torch.equal(a[i].logprobs, b[i].logprobs) for i in a)
    with pytest.raises(KeyError, match="the weights do not fit MixtralForCausalLM"):
        synced.load_weights({"lm_head.weight": other.lm_head.weight})
    half = make_engine("hf", model, tokenizer, batch_size=4, precision="bf16")
    for completion in half.generate(_requests(tokenizer), params):
        gap = (completion.logprobs - _forward(model, completion, 1.0)[0]).abs().mean()
        assert gap < 0.05  # bf16 arithmetic, same model
    assert next(model.parameters()).dtype == torch.float32  # the engine's copy, not the policy, went bf16


@pytest.mark.parametrize("name", NATIVE)
def test_native_and_hf_give_the_same_completions_and_routes(name):
    model, tokenizer = family_model(name)
    params = SamplingParams(12, record_routes=name in MOE_FAMILIES)
    native = {
        c.request_id: c
        for c in make_engine("native", model, tokenizer, 3).generate(_requests(tokenizer), params)
    }
    hf = {
        c.request_id: c for c in make_engine("hf", model, tokenizer, 3).generate(_requests(tokenizer), params)
    }
    for request_id, mine in native.items():
        assert mine.token_ids == hf[request_id].token_ids
        torch.testing.assert_close(mine.logprobs, hf[request_id].logprobs, atol=1e-4, rtol=0)
        if params.record_routes:
            assert torch.equal(mine.routed_experts, hf[request_id].routed_experts)
