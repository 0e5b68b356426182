"""Training precision and activation memory: bf16 autocast agrees with fp32 within stated tolerances and
keeps fp32 master weights; gradient checkpointing changes nothing but memory, router replay included."""

from __future__ import annotations

import pytest
import torch
import torch.utils._python_dispatch
from safetensors.torch import load_file

from everyprompt.models.experts import select_moe_kernel
from everyprompt.models.precision import (
    PrecisionError,
    autocast,
    cpu_attention_in_fp32,
    enable_gradient_checkpointing,
)
from everyprompt.pipeline import train
from tests.conftest import tiny_config

TEXTS = ["12+34=46", "7*8=56", "100-1=99", "3+3+3=9"]


def _batch(tokenizer):
    ids = [tokenizer(t).input_ids for t in TEXTS]
    width = max(map(len, ids))
    batch = torch.full((len(ids), width), tokenizer.pad_token_id)
    for i, row in enumerate(ids):
        batch[i, : len(row)] = torch.tensor(row)
    return batch, [len(r) for r in ids]


def _loss_and_grads(model, batch, lengths, dtype):
    from everyprompt.trainer.learner_side.logprobs import token_logprobs

    model.zero_grad(set_to_none=True)
    with autocast(model, dtype):
        logp, _ = token_logprobs(model, batch, lengths=lengths, pad_id=0)
    mask = torch.zeros_like(logp)
    for i, n in enumerate(lengths):
        mask[i, : n - 1] = 1
    (-(logp * mask).sum() / mask.sum()).backward()
    return logp.detach() * mask, torch.cat(
        [p.grad.flatten() for p in model.parameters() if p.grad is not None]
    )


def test_bf16_autocast_agrees_with_fp32_and_keeps_fp32_master_weights(tiny_model):
    model, tokenizer = tiny_model
    model.train()
    select_moe_kernel(model, "everyprompt")
    batch, lengths = _batch(tokenizer)
    logp32, grad32 = _loss_and_grads(model, batch, lengths, "fp32")
    logp16, grad16 = _loss_and_grads(model, batch, lengths, "bf16")
    # bf16 matmuls (8 mantissa bits) on a 2-layer model: measured mean |dlogp| 9.5e-3, gradient cosine 0.9992
    assert 0 < float((logp16 - logp32).abs().sum() / (logp32 != 0).sum()) < 2e-2
    assert float(torch.nn.functional.cosine_similarity(grad16, grad32, dim=0)) > 0.995
    assert all(p.dtype == torch.float32 for p in model.parameters())  # weights stay the fp32 master copy
    assert grad16.dtype == torch.float32  # and so do their gradients (the optimizer state follows them)


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(tiny_model):
    model, tokenizer = tiny_model
    model.train()
    batch, lengths = _batch(tokenizer)
    logp, grads = _loss_and_grads(model, batch, lengths, "fp32")
    enable_gradient_checkpointing(model)
    logp_ckpt, grads_ckpt = _loss_and_grads(model, batch, lengths, "fp32")
    torch.testing.assert_close(logp_ckpt, logp, atol=1e-6, rtol=0)
    torch.testing.assert_close(grads_ckpt, grads, atol=1e-6, rtol=1e-5)


def test_a_model_without_checkpointing_support_is_refused_by_name():
    with pytest.raises(PrecisionError, match="'model.gradient_checkpointing': Linear does not support it"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2))


@pytest.mark.long  # 6 s on 2 cores: `make test-long`
@pytest.mark.parametrize("replay", ["r2", "r3"])
def test_checkpointed_training_with_router_replay_equals_the_plain_run(tmp_path, replay):
    """The backward recomputes each layer's forward, routers included: the replayed routes must still be
    in force then, or the gradient is that of other experts than the loss saw."""
    settings = ["sft.steps=0", "rl.steps=2", f"rl.router_replay={replay}", "rl.old_logprobs=recompute"]
    train(tiny_config(*settings), run_dir=tmp_path / "plain")
    train(tiny_config(*settings, "model.gradient_checkpointing=true"), run_dir=tmp_path / "ckpt")
    plain = load_file(tmp_path / "plain" / "checkpoints" / "step_2" / "model.safetensors")
    ckpt = load_file(tmp_path / "ckpt" / "checkpoints" / "step_2" / "model.safetensors")
    assert plain.keys() == ckpt.keys()
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], atol=1e-6, rtol=0, msg=name)


def test_a_bf16_run_trains_end_to_end(tmp_path):
    trainer = train(tiny_config("sft.steps=2", "rl.steps=2", "model.dtype=bf16"), run_dir=tmp_path)
    assert trainer.step == 2
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())


class _AttentionDtypes(torch.utils._python_dispatch.TorchDispatchMode):
    """The dtype of the queries of every scaled-dot-product attention kernel called."""

    def __init__(self):
        super().__init__()
        self.dtypes: list[torch.dtype] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func.name() and "backward" not in func.name():
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


def test_cpu_attention_runs_in_fp32_under_bf16_autocast_and_is_unchanged_outside_it(tiny_model):
    model, tokenizer = tiny_model
    batch, lengths = _batch(tokenizer)
    with torch.no_grad():
        plain = model(input_ids=batch).logits
        with torch.autocast("cpu", dtype=torch.bfloat16), _AttentionDtypes() as before:
            model(input_ids=batch)
    assert not cpu_attention_in_fp32(model, "fp32")  # nothing to do without bf16
    try:
        assert cpu_attention_in_fp32(model, "bf16")
        with torch.no_grad():
            assert torch.equal(model(input_ids=batch).logits, plain)  # outside autocast: the same kernel
            with torch.autocast("cpu", dtype=torch.bfloat16), _AttentionDtypes() as after:
                model(input_ids=batch)
        _, grads = _loss_and_grads(model, batch, lengths, "bf16")  # and it trains
        assert torch.isfinite(grads).all()
    finally:
        model.set_attn_implementation("sdpa")
    assert before.dtypes and set(before.dtypes) == {torch.bfloat16}
    assert after.dtypes and set(after.dtypes) == {torch.float32}


def test_fp32_cpu_attention_is_only_for_sdpa_models_on_the_cpu(tiny_model):
    model, _ = tiny_model
    model.set_attn_implementation("eager")
    try:
        assert not cpu_attention_in_fp32(model, "bf16")
        assert model.config._attn_implementation == "eager"
    finally:
        model.set_attn_implementation("sdpa")
