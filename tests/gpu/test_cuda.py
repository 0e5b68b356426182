"""Checks that wait for a GPU (`make test-gpu`, `pytest -m gpu`): collected everywhere, skipped where torch
sees no CUDA device. They have run on an H100 and H200s (docs/gpu-runs.md says what ran where)."""

from __future__ import annotations

import json

import pytest
import torch

from everyprompt.rollout import GenerationRequest, SamplingParams
from everyprompt.rollout.native import NativeEngine
from everyprompt.rollout.native.weights import fp8_matmuls
from everyprompt.trainer import Learner
from everyprompt.trainer.learner_side.logprobs import token_logprobs
from tests.conftest import make_tiny_model, tiny_config
from tests.rollout.test_fp8_matmul import fp8_comparison
from tests.trainer.test_data_parallel import REWARDS
from tests.trainer.test_sides import _model, hand_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch sees none here"),
]
PROMPTS = ["37+48=", "1+2=", "123+456+789=", "9=", "5+5+5=", "800+1="]
CUDA = torch.device("cuda", 0)


def _requests(tokenizer):
    return [GenerationRequest(i, tokenizer(p).input_ids, seed=i) for i, p in enumerate(PROMPTS)]


def test_the_engine_on_cuda_gives_transformers_log_probs():
    model, tokenizer = make_tiny_model()
    model.to(CUDA)
    engine = NativeEngine.from_model(model, tokenizer, batch_size=4, device=CUDA)
    for completion in engine.generate(_requests(tokenizer), SamplingParams(16)):
        ids = torch.tensor([completion.prompt_ids + completion.token_ids], device=CUDA)
        with torch.no_grad():
            expected, _ = token_logprobs(model, ids)
        start = len(completion.prompt_ids) - 1
        torch.testing.assert_close(
            completion.logprobs, expected[0, start:].cpu(), atol=1e-4, rtol=0, msg=str(completion.request_id)
        )


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_low_precision_rollouts_on_cuda_agree_with_the_cpu(precision):
    model, tokenizer = make_tiny_model()
    params = SamplingParams(16, greedy=True, record_routes=True)
    on_cpu = {
        c.request_id: c
        for c in NativeEngine.from_model(model, tokenizer, 4, precision).generate(
            _requests(tokenizer), params
        )
    }
    # the CPU's path (fp8 weight-only) on CUDA too; FP8 matmuls are compared in the next test
    engine = NativeEngine.from_model(model, tokenizer, 4, precision, device=CUDA, fp8_matmul=False)
    agree = 0
    for completion in engine.generate(_requests(tokenizer), params):
        reference = on_cpu[completion.request_id]
        shared = min(len(completion.token_ids), len(reference.token_ids))
        agree += completion.token_ids == reference.token_ids
        gap = (completion.logprobs[:shared] - reference.logprobs[:shared]).abs().max()
        assert gap < 0.1, (completion.request_id, float(gap))  # bf16 / fp8 kernels round differently
    assert agree >= len(PROMPTS) // 2


@pytest.mark.skipif(not fp8_matmuls(CUDA), reason="needs FP8 matmuls (compute capability 9.0+)")
def test_fp8_matmuls_on_cuda_move_no_further_than_fp8_weights_do():
    """As tests/rollout/test_fp8_matmul.py on the CPU: torch._scaled_mm's CUDA kernel against the
    weight-only reference, on the same device."""
    found = fp8_comparison(CUDA)
    assert found["fp8 matmuls vs fp8 weights"][0] >= found["fp8 weights vs fp32"][0], found


def test_a_bf16_train_step_on_cuda():
    config = tiny_config("rl.old_logprobs=recompute", "rl.lr=1e-2", "model.dtype=bf16")
    model, tokenizer = _model(config)
    model.to(CUDA)
    learner = Learner(config, model, tokenizer.pad_token_id)
    before = {k: v.clone() for k, v in learner.state_dict().items()}
    metrics = learner.update(hand_batch(_model(config)[0], tokenizer, REWARDS[0]))
    assert torch.isfinite(torch.tensor(metrics["loss/policy"])) and metrics["actor/skipped_updates"] == 0
    assert all(v.device == CUDA for v in learner.state_dict().values())
    assert any(not torch.equal(before[k], v) for k, v in learner.state_dict().items())


def test_a_lora_run_on_cuda_holds_its_base_in_bf16_and_passes_its_checks(tmp_path):
    """`model.frozen_dtype` auto on CUDA (bf16 training by default): the base in bf16, the adapters in
    float32; the parity and packing checks pass on the widened base; the adapters train."""
    from everyprompt.pipeline import train
    from tests.models.test_lora import LORA

    trainer = train(tiny_config(*LORA, "sft.steps=0", "rl.steps=2"), run_dir=tmp_path)
    frozen = {(p.dtype, p.device.type) for p in trainer.model.parameters() if not p.requires_grad}
    assert frozen == {(torch.bfloat16, "cuda")}
    assert {p.dtype for p in trainer.model.parameters() if p.requires_grad} == {torch.float32}
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first["parity/logp_abs_diff"] < 1e-3


@pytest.mark.parametrize("compile", ["off", "on"], ids=["graphs", "compiled-graphs"])
def test_every_rl_step_after_the_first_replays_its_graphs(tmp_path, compile):
    """A real run on CUDA (the tiny model, bf16 engine): the engine stays awake with its graphs, captures in
    the first step and replays in every later one; no decode phase runs without its graph, and no capture
    is refused (the H200's RL step refused every graph under the first trust rule, 1e-3 on bf16 logits).
    With compiled bodies, the compile succeeds (on the H200 it failed in Triton, and the graphs then
    captured the eager bodies: this test passed without noticing)."""
    from everyprompt.pipeline import Run

    config = tiny_config(
        "rollout.precision=bf16", "rl.old_logprobs=recompute", "rl.steps=3", f"rollout.compile={compile}"
    )
    trainer = Run(config, tmp_path / "run").trainer()
    try:
        assert trainer.engine.decoding.graphs and trainer.engine.graphs.capture
        history = trainer.train()
    finally:
        trainer.close()
    assert [m["rollout/graph_failed"] for m in history] == [0.0, 0.0, 0.0], trainer.engine.graphs.failure
    assert [m.get("rollout/compile_failed", 0.0) for m in history] == [0.0] * 3, (
        trainer.engine.compiler.failure
    )
    assert trainer.engine.compiler.bound == (compile == "on")
    assert history[0]["rollout/graph_captures"] > 0
    for later in history[1:]:
        assert later["rollout/graph_eager_steps"] == 0.0 and later["rollout/graph_replays"] > 0


def test_the_throughput_bench_on_cuda(tmp_path):
    from tests.test_bench import _load, _saved_tiny_model

    bench = _load("throughput")
    model = _saved_tiny_model(tmp_path / "tiny")
    args = ["--model", str(model), "--quick", "--device", "cuda", "--dtype", "bf16", "--out", str(tmp_path)]
    assert bench.main(args) == 0
    payload = json.loads((tmp_path / "throughput_tiny_cuda.json").read_text())
    assert payload["device"] == "cuda:0" and all(row["floor_ms"] > 0 for row in payload["decode"])


# ------------------------------------------------------------------ CUDA graphs (rollout/native/graphs.py)
def _by_id(completions):
    return {c.request_id: c for c in completions}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "params",
    [SamplingParams(16, record_routes=True, record_router_logits=True), SamplingParams(16, greedy=True)],
    ids=["sampled-routes", "greedy"],
)
def test_cuda_graphs_replay_the_eager_static_step(precision, params):
    """The graphs run the very kernels the static step runs eagerly: the same tokens and routes, the same
    log-probs; captured once, replayed on later calls."""
    model, tokenizer = make_tiny_model()
    eager = NativeEngine.from_model(model, tokenizer, 4, precision, device=CUDA, cuda_graphs="static")
    expected = _by_id(eager.generate(_requests(tokenizer), params))
    graphs = NativeEngine.from_model(model, tokenizer, 4, precision, device=CUDA, cuda_graphs="on")
    for call in range(2):
        got = _by_id(graphs.generate(_requests(tokenizer), params))
        stats = graphs.stats
        assert stats["graph_failed"] == 0.0 and stats["graph_replays"] > 0, stats
        assert (stats["graph_captures"] > 0) == (call == 0), stats
        for request_id, reference in expected.items():
            assert got[request_id].token_ids == reference.token_ids
            torch.testing.assert_close(got[request_id].logprobs, reference.logprobs, atol=1e-5, rtol=0)
            if reference.routed_experts is not None:
                assert torch.equal(got[request_id].routed_experts, reference.routed_experts)


def test_the_overlapped_loop_on_cuda_gives_the_plain_steps_completions():
    """The static step on CUDA sends each forward before reading the step's tokens (rollout/native/
    decode_loop.py); the plain step reads first. The same tokens, log-probs within float32 rounding (the
    static step attends over its whole cache width), the same recorded routes."""
    from everyprompt.devices.placement import copy_later, read_later

    values = torch.arange(6, device=CUDA) * 3
    later, listed = copy_later(values), read_later(values)
    values.add_(1)  # queued after the copies: neither sees it
    assert torch.equal(later(), torch.arange(6) * 3) and listed() == [0, 3, 6, 9, 12, 15]
    model, tokenizer = make_tiny_model()
    params = SamplingParams(16, record_routes=True)
    plain = NativeEngine.from_model(model, tokenizer, 4, device=CUDA, cuda_graphs="off")
    expected = _by_id(plain.generate(_requests(tokenizer), params))
    overlapped = NativeEngine.from_model(model, tokenizer, 4, device=CUDA, cuda_graphs="on")
    for _ in range(2):  # captured, then replayed
        got = _by_id(overlapped.generate(_requests(tokenizer), params))
        assert overlapped.stats["overlapped"] == 1.0 and plain.stats["overlapped"] == 0.0
        for request_id, reference in expected.items():
            assert got[request_id].token_ids == reference.token_ids
            torch.testing.assert_close(got[request_id].logprobs, reference.logprobs, atol=1e-4, rtol=0)
            assert torch.equal(got[request_id].routed_experts, reference.routed_experts)


def test_an_episodes_observation_fed_in_one_forward_on_cuda_gives_transformers_log_probs():
    """The extend forward (rollout/native/extend.py) on CUDA, with the overlapped static step and its
    graphs around it: the model's tokens after an observation have a transformers forward's log-probs."""
    from tests.rollout.test_episodes import Scripted

    model, tokenizer = make_tiny_model()
    model.to(CUDA)
    prompt = tokenizer(PROMPTS[0]).input_ids
    engine = NativeEngine.from_model(model, tokenizer, 4, device=CUDA, cuda_graphs="on")
    (first,) = engine.generate([GenerationRequest(0, prompt)], SamplingParams(4, greedy=True))
    stop = tokenizer.decode(first.token_ids[1:2])  # ends the first turn at its second token
    observation = tokenizer("=85+17*3=136").input_ids
    params = SamplingParams(32, greedy=True, stop=(stop,))
    (done,) = engine.generate([GenerationRequest(0, prompt, episode=Scripted(observation))], params)
    mask = done.completion_mask
    assert engine.stats["extends"] == 1 and mask is not None and (~mask).sum() == len(observation)
    ids = torch.tensor([prompt + done.token_ids], device=CUDA)
    with torch.no_grad():
        expected, _ = token_logprobs(model, ids)
    expected = expected[0, len(prompt) - 1 :].cpu()
    torch.testing.assert_close(done.logprobs[mask], expected[mask], atol=1e-4, rtol=0)


def _cuda_kernels(fn) -> tuple[list[str], object]:
    """The names of the CUDA kernels `fn()` runs (torch's profiler), and what it returns."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA], result


def test_the_prefill_attends_without_cudnn_and_agrees_with_the_cpu():
    """The native engine's prefill leaves cuDNN's attention out on CUDA (devices/sdpa.py): no cuDNN kernel
    runs in a bf16 rollout of one token a prompt (a prefill and a sample), whose tokens and log-probs
    agree with the CPU engine's as bf16 kernels do. What torch picks for the same call on its own is
    printed, for the record."""
    import torch.nn.functional as F

    model, tokenizer = make_tiny_model()
    params = SamplingParams(1, greedy=True)
    on_cpu = _by_id(
        NativeEngine.from_model(model, tokenizer, 4, "bf16").generate(_requests(tokenizer), params)
    )
    engine = NativeEngine.from_model(model, tokenizer, 4, "bf16", device=CUDA)
    names, got = _cuda_kernels(lambda: _by_id(engine.generate(_requests(tokenizer), params)))
    assert not [name for name in names if "cudnn" in name.lower()], sorted(set(names))
    assert sum(got[i].token_ids == c.token_ids for i, c in on_cpu.items()) >= len(PROMPTS) // 2
    for request_id, reference in on_cpu.items():
        if got[request_id].token_ids == reference.token_ids:  # bf16 kernels round differently
            assert (got[request_id].logprobs - reference.logprobs).abs().max() < 0.1, request_id
    q = torch.randn(4, 2, 24, 16, device=CUDA, dtype=torch.bfloat16)
    kv = torch.randn(4, 1, 24, 16, device=CUDA, dtype=torch.bfloat16)
    own, _ = _cuda_kernels(lambda: F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True))
    print("torch's own choice for the prefill's attention:", sorted(set(own)))


def test_cuda_graphs_stay_valid_across_a_weight_sync():
    from everyprompt.models.lora import merged_state_dict

    model, tokenizer = make_tiny_model()
    other, _ = make_tiny_model()
    with torch.no_grad():
        for param in other.parameters():
            param.mul_(1.5)
    params = SamplingParams(16)
    graphs = NativeEngine.from_model(model, tokenizer, 4, "bf16", device=CUDA, cuda_graphs="on")
    list(graphs.generate(_requests(tokenizer), params))
    graphs.load_weights(merged_state_dict(other))
    got = _by_id(graphs.generate(_requests(tokenizer), params))
    assert graphs.stats["graph_captures"] == 0 and graphs.stats["graph_replays"] > 0
    fresh = NativeEngine.from_model(other, tokenizer, 4, "bf16", device=CUDA, cuda_graphs="static")
    for request_id, reference in _by_id(fresh.generate(_requests(tokenizer), params)).items():
        assert got[request_id].token_ids == reference.token_ids
        torch.testing.assert_close(got[request_id].logprobs, reference.logprobs, atol=1e-5, rtol=0)


def test_grouped_expert_matmuls_on_cuda_agree_with_the_batched_ones(monkeypatch):
    from everyprompt.rollout.native import moe

    model, tokenizer = make_tiny_model()
    params = SamplingParams(16, greedy=True, record_routes=True)
    grouped = NativeEngine.from_model(model, tokenizer, 4, "bf16", device=CUDA, cuda_graphs="off")
    flat = torch.zeros(2, model.config.hidden_size, dtype=torch.bfloat16, device=CUDA)
    gate_up, down = grouped.layers[0].experts
    assert moe._grouped_on_device(flat, gate_up, down)  # bf16 on an sm80+ card: the grouped path
    expected = _by_id(grouped.generate(_requests(tokenizer), params))
    monkeypatch.setattr(moe, "_grouped_on_device", lambda *args: False)
    batched = _by_id(grouped.generate(_requests(tokenizer), params))
    agree = sum(batched[i].token_ids == expected[i].token_ids for i in expected)
    assert agree >= len(PROMPTS) - 1  # bf16: the two paths sum in another order
    for i in expected:
        shared = min(len(batched[i].token_ids), len(expected[i].token_ids))
        gap = (batched[i].logprobs[:shared] - expected[i].logprobs[:shared]).abs().max()
        assert gap < 0.05, (i, float(gap))


def test_adamw_is_fused_on_cuda():
    from everyprompt.trainer.learner_side.optim import build_optimizer

    model, _ = make_tiny_model()
    assert build_optimizer(model.to(CUDA), 1e-3, 0.0).defaults["fused"] is True


def test_a_bf16_norm_on_cuda_is_one_kernel_and_equals_the_upcast_one():
    """The engine's bf16 RMSNorm (attention.rms_norm) on CUDA: the upcast reference's values, in fewer
    kernels than upcast, normalise and cast back."""
    import torch.nn.functional as F

    from everyprompt.rollout.native.attention import rms_norm

    x = (torch.randn(64, 1, 576, device=CUDA) * 3).bfloat16()
    reference = F.rms_norm(x.float(), x.shape[-1:], eps=1e-5).bfloat16()
    got = rms_norm(x, None, 1e-5)
    assert (got.float() - reference.float()).abs().max().item() <= 2**-7 * reference.abs().max().item()
    upcast, _ = _cuda_kernels(lambda: F.rms_norm(x.float(), x.shape[-1:], eps=1e-5).bfloat16())
    fused, _ = _cuda_kernels(lambda: rms_norm(x, None, 1e-5))
    assert len(fused) < len(upcast)


def test_liger_kernels_give_torchs_log_probs_and_gradients(monkeypatch):
    """`model.kernels=liger` on a tiny Llama (SmolLM2's family): the packed forward's log-probs and the
    gradients of their sum equal torch's kernels' (fp32, within Liger's own test tolerances)."""
    pytest.importorskip("liger_kernel", reason="liger-kernel is the optional extra everyprompt[kernels]")
    import copy

    from transformers.models.llama import modeling_llama

    from everyprompt.models.liger import apply_liger

    for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):  # Liger patches the module: restore
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))
    plain = _tiny_llama()
    fused = copy.deepcopy(plain)
    tokens = torch.randint(1, 64, (3, 12), device=CUDA)
    lengths = [12, 7, 9]

    def logprobs_and_grads(model):
        logp, _ = token_logprobs(model, tokens, lengths=lengths)
        logp.sum().backward()
        return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    expected, expected_grads = logprobs_and_grads(plain)
    apply_liger(fused)
    assert fused.model.norm._get_name() == "LigerRMSNorm"  # Liger binds its forward into the module
    got, grads = logprobs_and_grads(fused)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for name, value in expected_grads.items():
        torch.testing.assert_close(grads[name], value, atol=1e-4, rtol=1e-3, msg=name)


def test_compiled_layers_give_the_eager_layers_log_probs_and_gradients_on_cuda():
    """`model.kernels=compiled` on a tiny Llama under bf16 autocast on the card (Triton's kernels): a packed
    forward's log-probs and the gradients of their sum equal the eager layers' within bf16's rounding, at
    two widths, one of them with rows that hold two sequences (a mask)."""
    import copy

    from everyprompt.models.compiled_layers import compile_layers, compiled_layer_count

    eager = _tiny_llama()
    compiled = copy.deepcopy(eager)
    compile_layers(compiled)
    for width, lengths in ((12, [12, 7, 9]), (17, [17, 3, 11, 6])):
        tokens = torch.randint(1, 64, (len(lengths), width), device=CUDA)
        results = []
        for model in (eager, compiled):
            model.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logp, _ = token_logprobs(model, tokens, lengths=lengths)
            logp.float().sum().backward()
            results.append((logp.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        (expected, expected_grads), (got, grads) = results
        torch.testing.assert_close(got, expected, atol=0.05, rtol=0.02)
        for name, value in expected_grads.items():  # relative to the gradient's size: bf16's rounding
            assert (grads[name] - value).norm() <= 0.02 * value.norm() + 1e-6, name
    assert compiled_layer_count(compiled) == 2  # nothing fell back to eager


def _tiny_llama():
    """A random-init 2-layer Llama (SmolLM2's family) on the card, the same each call."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config).to(CUDA)
