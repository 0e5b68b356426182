"""The learner's attention on CUDA (models/attention.py): transformers' SDPA attention with cuDNN's backend
left out, the other backends as they were, and the same values."""

import torch
from transformers.integrations import sdpa_attention

from everyprompt.models.attention import (
    CUDA_SDPA,
    _sdpa_without_cudnn,
    cuda_attention_without_cudnn,
    register,
    uses_sdpa,
)
from tests.conftest import tiny_config
from tests.trainer.test_sides import _model


def _backends() -> dict[str, bool]:
    cuda = torch.backends.cuda
    return {
        "cudnn": cuda.cudnn_sdp_enabled(),
        "flash": cuda.flash_sdp_enabled(),
        "efficient": cuda.mem_efficient_sdp_enabled(),
        "math": cuda.math_sdp_enabled(),
    }


def test_the_attention_leaves_out_cudnn_and_computes_what_sdpa_does(monkeypatch):
    seen = []
    forward = sdpa_attention.sdpa_attention_forward

    def spying(*args, **kwargs):
        seen.append(_backends())
        return forward(*args, **kwargs)

    module = torch.nn.Module()
    module.is_causal, module.training = True, False
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 4, 7, 16, generator=generator) for _ in range(3))
    before = _backends()
    expected, _ = forward(module, query, key, value, None)
    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", spying)
    got, _ = _sdpa_without_cudnn(module, query, key, value, None)
    assert seen == [{"cudnn": False, "flash": True, "efficient": True, "math": True}]
    assert _backends() == before  # restored after the call
    assert torch.equal(got, expected)


def test_only_a_cuda_model_with_sdpa_attention_gets_it():
    model, _ = _model(tiny_config())
    assert model.config._attn_implementation == "sdpa"
    assert not cuda_attention_without_cudnn(model)  # on the CPU: transformers' own
    assert model.config._attn_implementation == "sdpa"
    assert uses_sdpa(model.config)
    register()
    model.set_attn_implementation(CUDA_SDPA)
    assert uses_sdpa(model.config)  # a packed micro-batch's mask is still made on the host
    model.set_attn_implementation("eager")
    assert not uses_sdpa(model.config)
