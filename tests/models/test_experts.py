"""The sorted MoE training kernel: same outputs and gradients as transformers' own experts code."""

import pytest
import torch

from everyprompt.config import ConfigError, load_config
from everyprompt.models.experts import (
    KERNEL_NAME,
    select_moe_kernel,
    sorted_experts_forward,
    use_sorted_experts,
)
from tests.conftest import TINY_LAYERS
from tests.families import family_model


def _loss_and_grads(model, ids: torch.Tensor, implementation: str):
    model.set_experts_implementation(implementation)
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=32, **TINY_LAYERS, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
        )
    )


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe"])
def test_sorted_kernel_equals_the_eager_experts_in_loss_and_every_gradient(kind):
    """Eager is transformers' per-expert loop, the definition; router weights get their gradient through
    the gate weights, the experts through the grouped matmuls, the embeddings through index_add."""
    model = _qwen3_moe() if kind == "qwen3_moe" else family_model(kind)[0]
    assert use_sorted_experts(model) and model.config._experts_implementation == KERNEL_NAME
    ids = torch.randint(0, 32, (3, 11), generator=torch.Generator().manual_seed(1))
    loss, grads = _loss_and_grads(model, ids, KERNEL_NAME)
    reference_loss, reference = _loss_and_grads(model, ids, "eager")
    torch.testing.assert_close(loss, reference_loss, atol=1e-6, rtol=0)
    assert grads.keys() == reference.keys() and any("gate" in n and "experts" not in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference[name], atol=1e-6, rtol=1e-5, msg=name)


def test_sorted_kernel_with_an_idle_expert_and_a_crowded_one():
    """Hand-made routing: expert 3 gets no token, expert 0 five of six pairs' first slot."""
    model = _qwen3_moe()
    experts = model.model.layers[0].mlp.experts
    hidden = torch.randn(6, 16, requires_grad=True, generator=torch.Generator().manual_seed(2))
    index = torch.tensor([[0, 1], [0, 2], [0, 1], [2, 0], [0, 2], [1, 2]])
    weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(3))
    model.set_experts_implementation("eager")
    expected = experts(hidden, index, weights)
    got = sorted_experts_forward(experts, hidden, index, weights)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    (grad,) = torch.autograd.grad(got.square().sum(), hidden)
    (expected_grad,) = torch.autograd.grad(expected.square().sum(), hidden)
    torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=1e-5)


def test_bf16_experts_on_the_cpu_multiply_on_float32_kernels(monkeypatch):
    """bf16 weights on the CPU: every grouped product takes float32 operands (torch's CPU bf16 grouped_mm
    caches a oneDNN primitive per group's row count, growing the process as routing changes), and the
    result is the bf16 computation's: each product of bf16 operands rounded to bf16, as the per-expert
    loop of bf16 matmuls computes it (within one bf16 unit: only the order of additions differs)."""
    import torch.nn.functional as F

    model = _qwen3_moe().to(torch.bfloat16)
    experts = model.model.layers[0].mlp.experts
    hidden = torch.randn(6, 16, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    index = torch.tensor([[0, 1], [0, 2], [0, 1], [2, 0], [0, 2], [1, 2]])
    weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    operands = []
    grouped_mm = F.grouped_mm
    monkeypatch.setattr(
        F, "grouped_mm", lambda a, b, **kw: operands.append((a.dtype, b.dtype)) or grouped_mm(a, b, **kw)
    )
    got = sorted_experts_forward(experts, hidden, index, weights)
    assert operands == [(torch.float32, torch.float32)] * 2 and got.dtype == torch.bfloat16
    model.set_experts_implementation("eager")
    expected = experts(hidden, index, weights)
    torch.testing.assert_close(got, expected, atol=0, rtol=2**-7)


def test_kernel_selection_follows_the_config_and_skips_dense_models():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = _qwen3_moe()
    default = model.config._experts_implementation
    assert select_moe_kernel(model, "transformers").config._experts_implementation == default
    assert select_moe_kernel(model, "everyprompt").config._experts_implementation == KERNEL_NAME
    dense = Qwen3ForCausalLM(Qwen3Config(vocab_size=32, intermediate_size=32, **TINY_LAYERS))
    assert not use_sorted_experts(dense)
    with pytest.raises(ConfigError, match="moe_kernel"):
        load_config(None, ["model.moe_kernel=fast"])


def _experts_modules(model) -> list:
    return [m for m in model.modules() if hasattr(m, "gate_up_proj")]


@pytest.mark.parametrize("flag", ["has_post_expert_norm", "_is_expert_parallel"])
def test_a_feature_flag_the_experts_lack_is_off(flag):
    """transformers 5.17 (the version on the GPU image this first ran on) has neither flag: the kernel
    fits there; where the flag says the feature is on, it does not."""
    model = _qwen3_moe()
    for module in _experts_modules(model):
        vars(module).pop(flag, None)
        assert not hasattr(module, flag)
    assert use_sorted_experts(model)
    for module in _experts_modules(model):
        setattr(module, flag, True)
    assert not use_sorted_experts(model)


def test_a_layout_flag_the_experts_lack_is_refused():
    model = _qwen3_moe()
    for module in _experts_modules(model):
        vars(module).pop("is_transposed", None)
        assert not hasattr(module, "is_transposed")
    assert not use_sorted_experts(model)


def test_checkpoints_do_not_name_the_kernel(tmp_path):
    """A saved policy loads anywhere with stock transformers: the choice is not written to config.json."""
    from transformers import AutoModelForCausalLM

    model = _qwen3_moe()
    use_sorted_experts(model)
    model.save_pretrained(tmp_path)
    assert KERNEL_NAME not in (tmp_path / "config.json").read_text()
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config._experts_implementation != KERNEL_NAME
