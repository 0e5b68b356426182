"""bf16 products on float32 kernels (models/emulated_bf16.py) against torch's own bf16 kernels: the same
dtype, bit-equal for nearly every output and within one bf16 unit in the last place for the rest, the
gradients as close; products torch would not compute in bf16 untouched; `model.cpu_bf16` decides."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from everyprompt.config import ConfigError
from everyprompt.models import precision
from everyprompt.models.emulated_bf16 import EmulatedBf16
from everyprompt.models.precision import autocast, emulates_bf16
from tests.conftest import ProductDtypes, tiny_config

ULP = 2.0**-7  # one bf16 unit in the last place, relative to the value (8 significant bits)


def _operands(*shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator) * 0.3 for shape in shapes]


PRODUCTS = {
    "linear": (lambda x, w, b: F.linear(x, w, b), [(3, 40, 96), (64, 96), (64,)]),
    "linear, no bias": (lambda x, w: F.linear(x, w), [(120, 96), (64, 96)]),
    "matmul": (lambda a, b: torch.matmul(a, b), [(2, 30, 96), (96, 48)]),
    "@": (lambda a, b: a @ b, [(30, 96), (96, 48)]),
    "mm": (lambda a, b: torch.mm(a, b), [(30, 96), (96, 48)]),
    "bmm": (lambda a, b: torch.bmm(a, b), [(4, 30, 96), (4, 96, 48)]),
    "addmm": (lambda c, a, b: torch.addmm(c, a, b), [(48,), (30, 96), (96, 48)]),
    "baddbmm": (lambda c, a, b: torch.baddbmm(c, a, b), [(4, 30, 48), (4, 30, 96), (4, 96, 48)]),
    "einsum": (lambda a, b: torch.einsum("bij,jk->bik", [a, b]), [(2, 30, 96), (96, 48)]),
}


def _close_to_native(got: torch.Tensor, native: torch.Tensor) -> None:
    assert got.dtype == native.dtype == torch.bfloat16
    assert got.shape == native.shape
    difference = (got.float() - native.float()).abs()
    assert float((difference == 0).float().mean()) > 0.98  # most outputs bit-equal
    assert bool((difference <= ULP * native.float().abs() + 1e-30).all())  # the rest one unit apart


@pytest.mark.parametrize("name", list(PRODUCTS))
def test_each_product_under_autocast_agrees_with_torchs_bf16_kernels(name):
    func, shapes = PRODUCTS[name]
    native_inputs = [t.requires_grad_() for t in _operands(*shapes)]
    emulated_inputs = [t.detach().clone().requires_grad_() for t in native_inputs]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        native = func(*native_inputs)
        with EmulatedBf16():
            got = func(*emulated_inputs)
    _close_to_native(got, native)
    upstream = _operands(native.shape, seed=1)[0]
    (native.float() * upstream).sum().backward()
    (got.float() * upstream).sum().backward()  # outside the mode, as the trainer's backward passes are
    for a, b in zip(emulated_inputs, native_inputs, strict=True):
        assert a.grad.dtype == b.grad.dtype == torch.float32  # fp32 leaves keep fp32 gradients
        scale = float(b.grad.abs().max())
        assert float((a.grad - b.grad).abs().max()) <= 2 * ULP * scale


def test_bf16_operands_outside_autocast_and_an_out_tensor():
    a, b = (t.to(torch.bfloat16) for t in _operands((30, 96), (96, 48)))
    native = torch.mm(a, b)
    out = torch.empty(30, 48, dtype=torch.bfloat16)
    with EmulatedBf16():
        returned = torch.mm(a, b, out=out)
    assert returned is out
    _close_to_native(out, native)


def test_products_torch_would_not_run_in_bf16_are_untouched():
    a, b = _operands((30, 96), (96, 48))
    with EmulatedBf16():
        plain = a @ b  # fp32 operands, no autocast
        mixed = torch.mm(a.to(torch.bfloat16).float(), b)
    assert plain.dtype == torch.float32 and torch.equal(plain, a @ b)
    assert torch.equal(mixed, torch.mm(a.to(torch.bfloat16).float(), b))
    with torch.autocast("cpu", dtype=torch.bfloat16), EmulatedBf16():
        summed = a.sum()  # not a product: autocast's own rule
        wide = a.double() @ b.double()  # autocast leaves float64 products alone, and so does the mode
    assert summed.dtype == torch.float32
    assert wide.dtype == torch.float64 and torch.equal(wide, a.double() @ b.double())


def test_the_mode_computes_on_float32_kernels_forward_and_backward():
    """What makes it fast: no product reaches torch in bf16 (counted at the dispatcher)."""
    x, w = (t.requires_grad_() for t in _operands((16, 96), (64, 96)))
    with ProductDtypes() as products:
        with torch.autocast("cpu", dtype=torch.bfloat16), EmulatedBf16():
            y = F.linear(x, w)
        y.float().sum().backward()
    assert len(products.dtypes) == 3 and set(products.dtypes) == {torch.float32}, products.dtypes
    with ProductDtypes() as products, torch.autocast("cpu", dtype=torch.bfloat16):
        F.linear(x, w)
    assert products.dtypes == [torch.bfloat16]  # the check can fail: without the mode, torch's bf16 kernel


@pytest.mark.parametrize("variant", ["fused head", "checkpointed head", "gradient checkpointing"])
def test_a_training_step_of_a_model_makes_no_bf16_product(tiny_model, variant):
    """What runs in the backward pass, outside the mode, stays on float32 kernels: the fused head's
    backward (LinearLogSoftmax), the head's checkpointed chunks recomputed (a head with a hook does not
    fit the fused path) and checkpointed layers recomputed."""
    model, tokenizer = tiny_model
    model.train()
    if variant == "checkpointed head":
        model.get_output_embeddings().register_forward_hook(lambda *_: None)
    if variant == "gradient checkpointing":
        precision.enable_gradient_checkpointing(model)
    batch = torch.tensor([tokenizer("12+34=46 and 7*8=56").input_ids] * 3)
    with ProductDtypes() as products:
        _loss_and_grads(model, batch, "emulated", chunk=16)
    assert products.dtypes and set(products.dtypes) == {torch.float32}
    with ProductDtypes() as products:
        _loss_and_grads(model, batch, "native", chunk=16)
    assert torch.bfloat16 in products.dtypes  # the check can fail: torch's own bf16 kernels


def _loss_and_grads(model, batch, cpu_bf16: str, dtype: str = "bf16", chunk: int = 0):
    """Log-probs and gradients of `batch`; `chunk` > 0 runs the LM head on chunks of positions, as the
    trainer does (trainer/learner_side/head.py), 0 on the model's full logits."""
    from everyprompt.trainer.learner_side.logprobs import token_logprobs

    model.zero_grad(set_to_none=True)
    with autocast(model, dtype, cpu_bf16):
        logp, _ = token_logprobs(model, batch, pad_id=0, chunk=chunk)
    (-logp.mean()).backward()
    return logp.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_a_models_loss_and_gradients_match_native_bf16_far_closer_than_fp32(tiny_model):
    model, tokenizer = tiny_model
    model.train()
    batch = torch.tensor([tokenizer("12+34=46 and 7*8=56").input_ids] * 3)
    native_logp, native_grad = _loss_and_grads(model, batch, "native")
    emulated_logp, emulated_grad = _loss_and_grads(model, batch, "emulated")
    fp32_logp, fp32_grad = _loss_and_grads(model, batch, "native", dtype="fp32")
    to_native = float((emulated_logp - native_logp).abs().max())
    fp32_to_native = float((fp32_logp - native_logp).abs().max())
    assert to_native < fp32_to_native / 10, (to_native, fp32_to_native)
    cosine = F.cosine_similarity(emulated_grad, native_grad, dim=0)
    fp32_cosine = F.cosine_similarity(fp32_grad, native_grad, dim=0)
    assert float(1 - cosine) < float(1 - fp32_cosine) / 10, (float(cosine), float(fp32_cosine))


def test_cpu_bf16_decides_where_products_are_emulated(monkeypatch):
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert emulates_bf16(cpu, "bf16", "emulated") and not emulates_bf16(cpu, "bf16", "native")
    assert not emulates_bf16(cpu, "fp32", "emulated")  # fp32 training: nothing in bf16
    assert not emulates_bf16(cpu, "auto", "emulated")  # auto is fp32 on the CPU
    assert not emulates_bf16(meta, "bf16", "emulated")  # only a CPU's products
    monkeypatch.setattr(precision, "cpu_bf16_slowdown", lambda: 31.0)  # an AVX2-only CPU
    assert emulates_bf16(cpu, "bf16", "auto")
    monkeypatch.setattr(precision, "cpu_bf16_slowdown", lambda: 1.1)  # AVX-512 BF16 or AMX
    assert not emulates_bf16(cpu, "bf16", "auto")


def test_an_unknown_cpu_bf16_setting_names_the_key():
    with pytest.raises(ConfigError, match="cpu_bf16"):
        tiny_config("model.cpu_bf16=fast")
