"""The rollout engines' attention kernels (devices/sdpa.py): on a CUDA device the native engine's prefill
and the transformers engine's every step attend without cuDNN's backend (whose per-shape plans their
changing widths would pay for), the native decode step with torch's choice; on the CPU torch's choice
stands, and either way the completions are the same."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from everyprompt.devices.fake_cuda import fake_cuda
from everyprompt.models.experts import use_sorted_experts
from everyprompt.rollout import GenerationRequest, SamplingParams
from everyprompt.rollout.hf import HFEngine
from everyprompt.rollout.native import NativeEngine
from tests.conftest import make_tiny_model


def _requests(tokenizer):
    prompts = ["the cat sat", "a dog ran far away", "one", "two birds sang"]
    return [GenerationRequest(f"r{i}", tokenizer.encode(p), seed=i) for i, p in enumerate(prompts)]


def _spied(monkeypatch) -> list[tuple[bool, bool]]:
    """Each attention call from now on: (without a mask, a prefill's; whether cuDNN's kernel was allowed)."""
    calls = []
    attend = F.scaled_dot_product_attention

    def spying(query, key, value, attn_mask=None, **kwargs):
        calls.append((attn_mask is None, torch.backends.cuda.cudnn_sdp_enabled()))
        return attend(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spying)
    return calls


def _on(device: str):
    return fake_cuda() if device != "cpu" else contextlib.nullcontext()


def _tokens(engine, tokenizer) -> dict:
    return {
        c.request_id: c.token_ids
        for c in engine.generate(_requests(tokenizer), SamplingParams(6, greedy=True))
    }


@pytest.mark.parametrize("device", ["cuda:0", "cpu"])
def test_the_engine_attends_without_cudnn_on_cuda_only(tiny_model, device, monkeypatch):
    model, tokenizer = tiny_model
    expected = _tokens(NativeEngine.from_model(model, tokenizer, 2, "bf16"), tokenizer)
    calls = _spied(monkeypatch)
    with _on(device):
        got = _tokens(NativeEngine.from_model(model, tokenizer, 2, "bf16", device=device), tokenizer)
    layers = model.config.num_hidden_layers
    prefills = [allowed for prefill, allowed in calls if prefill]
    decodes = [allowed for prefill, allowed in calls if not prefill]
    # 4 prompts in a pool of 2: admissions refill freed rows, and bf16 decode steps attend through SDPA too
    assert len(prefills) >= 2 * layers and len(decodes) >= 5 * layers
    assert set(prefills) == {device == "cpu"}  # cuDNN left out of the prefill on CUDA alone
    # a decode step keeps torch's choice: a mask over grouped heads, which without cuDNN only math takes
    assert set(decodes) == {True}
    assert torch.backends.cuda.cudnn_sdp_enabled()  # and the process's own setting restored after
    assert got == expected


@pytest.mark.parametrize("device", ["cuda:0", "cpu"])
def test_the_hf_engine_attends_without_cudnn_on_cuda_only(device, monkeypatch):
    model, tokenizer = make_tiny_model()
    use_sorted_experts(model)  # transformers' own experts kernel takes CUDA-only branches on (fake) cuda
    expected = _tokens(HFEngine.from_model(model, tokenizer, 2), tokenizer)
    calls = _spied(monkeypatch)
    with _on(device):
        got = _tokens(HFEngine.from_model(model, tokenizer, 2, device=device), tokenizer)
    assert len(calls) >= 5 * model.config.num_hidden_layers
    assert {allowed for _, allowed in calls} == {device == "cpu"}  # its every call: widths change each step
    assert model.config._attn_implementation == "sdpa"  # the trainer's own model keeps its attention
    assert got == expected
