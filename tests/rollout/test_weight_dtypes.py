"""What an engine holds each weight in (`weight_dtypes`), and weights cast to it before they are sent
(`as_held`, `cluster.sync_dtype=engine`): the engine ends up holding the same bits, from fewer bytes."""

from __future__ import annotations

from dataclasses import fields, is_dataclass

import pytest
import torch

from everyprompt.models.io import as_held, weights_as_held
from everyprompt.models.lora import merged_state_dict, weights_nbytes
from everyprompt.rollout import GenerationRequest, SamplingParams, make_engine
from everyprompt.rollout.native.families import FAMILIES
from everyprompt.rollout.native.weights import FP8Weight
from tests.families import FAMILY_CONFIGS, family_model
from tests.models.test_lora import adapted_policy

NATIVE_FAMILIES = sorted(set(FAMILIES) & set(FAMILY_CONFIGS))


def test_as_held_narrows_floats_and_nothing_else():
    x = torch.tensor([1.0 + 2**-12, -3.0])  # 1 + 2^-12 has no bf16 value: the cast rounds it to 1
    narrowed = as_held(x, torch.bfloat16)
    assert narrowed.dtype == torch.bfloat16 and narrowed.tolist() == [1.0, -3.0]
    assert torch.equal(narrowed, x.to(torch.bfloat16))
    half = x.to(torch.bfloat16)
    assert as_held(half, torch.float32) is half  # never widened
    assert as_held(x, None) is x  # a weight the engine computes from (fp8's projections): as sent
    assert as_held(x, torch.float32) is x
    ids = torch.arange(3)
    assert as_held(ids, torch.bfloat16) is ids  # integers are not weights to round
    fp16 = x.to(torch.float16)
    assert as_held(fp16, torch.bfloat16) is fp16  # as many bytes either way: nothing to save
    pairs = dict(weights_as_held({"a": x, "b": ids}, {"a": torch.bfloat16}))
    assert pairs["a"].dtype == torch.bfloat16 and pairs["b"] is ids
    assert dict(weights_as_held({"a": x}, None))["a"] is x


def _tensors(value, out: list) -> list[torch.Tensor]:
    """Every tensor an engine holds in `value` (tensors, FP8Weights, tuples, lists, dataclasses), in order."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, FP8Weight):
        out += [value.data, value.scale]
    elif isinstance(value, (tuple, list)):
        for item in value:
            _tensors(item, out)
    elif is_dataclass(value):
        for field in fields(value):
            _tensors(getattr(value, field.name), out)
    return out


def _held(engine) -> list[torch.Tensor]:
    if hasattr(engine, "layers"):
        return _tensors([engine.embed, engine.final_norm, engine.lm_head, engine.layers], [])
    return list(engine.model.state_dict().values())


def _decoded(engine, tokenizer) -> dict:
    requests = [GenerationRequest(i, tokenizer(p).input_ids, seed=i) for i, p in enumerate(["1+2=", "30+4="])]
    return {c.request_id: c for c in engine.generate(requests, SamplingParams(6, temperature=1.0))}


def _sent_narrowed_holds_the_same(engine_name: str, model_type: str) -> None:
    """Two bf16 engines over one model, synced to other float32 weights: as they are, and each weight cast
    to the engine's `weight_dtypes` first; they hold the same bits and sample the same tokens."""
    model, tokenizer = family_model(model_type)
    other, _ = family_model(model_type, seed=3)
    weights = dict(other.state_dict())
    plain = make_engine(engine_name, model, tokenizer, batch_size=2, precision="bf16")
    narrow = make_engine(engine_name, model, tokenizer, batch_size=2, precision="bf16")
    sent = dict(weights_as_held(weights, narrow.weight_dtypes()))
    # every weight the engine reads is held in bf16 (DeepSeek-V3's routing bias aside)
    assert weights_nbytes(sent) < 0.55 * weights_nbytes(weights)
    plain.load_weights(weights)
    narrow.load_weights(sent)
    a, b = _held(plain), _held(narrow)
    assert len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))
    first, second = _decoded(plain, tokenizer), _decoded(narrow, tokenizer)
    assert all(first[i].token_ids == second[i].token_ids for i in first)
    assert all(torch.equal(first[i].logprobs, second[i].logprobs) for i in first)


@pytest.mark.parametrize("model_type", NATIVE_FAMILIES)
def test_the_native_engine_in_bf16_holds_the_same_bits_from_weights_sent_narrowed(model_type):
    _sent_narrowed_holds_the_same("native", model_type)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_an_fp8_engine_quantises_from_its_projections_as_sent(model_type):
    """fp8 quantises each projection and expert stack from the weight it is given: casting it first would
    change its scales, so none of them is listed (they go as sent); the rest (embeddings, norms, routers,
    the head) are listed, held in float32."""
    model, tokenizer = family_model(model_type)
    engine = make_engine("native", model, tokenizer, batch_size=2, precision="fp8")
    dtypes = engine.weight_dtypes()
    quantised = {n for n in model.state_dict() if "_proj" in n and n.endswith(".weight") or ".experts." in n}
    assert quantised and set(model.state_dict()) - set(dtypes) == quantised
    assert set(dtypes.values()) == {torch.float32}


def test_the_native_engine_names_deepseek_routing_bias_float32():
    model, tokenizer = family_model("deepseek_v3")
    dtypes = make_engine("native", model, tokenizer, batch_size=2, precision="bf16").weight_dtypes()
    biases = [name for name in dtypes if name.endswith("e_score_correction_bias")]
    assert biases and all(dtypes[name] == torch.float32 for name in biases)
    assert dtypes["model.layers.0.self_attn.kv_b_proj.weight"] == torch.bfloat16


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_the_hf_engine_in_bf16_holds_the_same_bits_from_weights_sent_narrowed(model_type):
    _sent_narrowed_holds_the_same("hf", model_type)


def test_a_bf16_base_lora_policy_sends_its_float32_merges_in_bf16():
    """A bf16 base's adapted weights merge in float32 (the adapters' dtype): a bf16 engine holds them in
    bf16, so they go in half the bytes, and the engine holds what it held from the float32 merges."""
    policy, tokenizer = adapted_policy(torch.bfloat16)
    merged = merged_state_dict(policy)
    adapted = [name for name in merged if merged.dtype_of(name) == torch.float32]
    assert adapted  # the adapters' layers
    engine = make_engine("native", policy, tokenizer, batch_size=2, precision="bf16")
    sent = dict(weights_as_held(merged, engine.weight_dtypes()))
    assert all(sent[name].dtype == torch.bfloat16 for name in adapted)
    assert weights_nbytes(sent) < weights_nbytes(dict(merged.items()))
    reference = make_engine("native", policy, tokenizer, batch_size=2, precision="bf16")
    reference.load_weights(merged)
    engine.load_weights(sent)
    a, b = _held(reference), _held(engine)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("model_type", NATIVE_FAMILIES)
def test_the_native_engine_holds_no_memory_of_the_weights_it_is_given(model_type):
    """In float32 on the CPU most reads are no-op casts: every weight the engine keeps is still its own
    (a [1, H] gate's transpose moves nothing and had shared the policy's parameter), so neither a
    learner's update between syncs nor a sync's read-only buckets reach it."""
    model, tokenizer = family_model(model_type)
    weights = dict(model.state_dict())
    engine = make_engine("native", model, tokenizer, batch_size=2)
    engine.load_weights(weights)
    given = {t.untyped_storage().data_ptr() for t in weights.values()}
    held = [t for t in _held(engine) if t.numel()]
    assert held and not [t.shape for t in held if t.untyped_storage().data_ptr() in given]
