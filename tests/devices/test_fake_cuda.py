"""The fake CUDA device (devices/fake_cuda.py): what it catches, and the native engine's rollout on it.

A rollout on "cuda:0" must equal the CPU one token for token (the same code, the same CPU kernels
underneath), touch no CPU tensor on the way, and read back from the device at most a few times per
decode step. Each check is shown able to fail: a CPU tensor planted in each path is named."""

import pytest
import torch

from everyprompt.devices.fake_cuda import DeviceMismatch, FakeCudaTensor, fake_cuda, real
from everyprompt.models.experts import use_sorted_experts
from everyprompt.rollout import GenerationRequest, SamplingParams
from everyprompt.rollout.hf import HFEngine
from everyprompt.rollout.native import NativeEngine
from everyprompt.rollout.native import engine as engine_module
from everyprompt.rollout.native import rows as rows_module
from everyprompt.rollout.native import weights as weights_module
from tests.conftest import make_tiny_model
from tests.rollout.test_fp8_matmul import needs_scaled_mm

PROMPTS = ["37+48=", "1+2=", "123+456+789=", "9=", "5+5+5=", "800+1="]
CUDA = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def tiny_model():
    return make_tiny_model()


def _requests(tokenizer):
    return [GenerationRequest(i, tokenizer(p).input_ids, seed=i) for i, p in enumerate(PROMPTS)]


def _generate(model, tokenizer, device, precision="fp32", **params):
    """`precision` "fp8 matmuls": fp8 weights multiplied by FP8 matmuls (as on an FP8 GPU)."""
    fp8_matmul = precision == "fp8 matmuls"
    engine = NativeEngine.from_model(
        model, tokenizer, 4, "fp8" if fp8_matmul else precision, device=device, fp8_matmul=fp8_matmul
    )
    completions = {
        c.request_id: c for c in engine.generate(_requests(tokenizer), SamplingParams(16, **params))
    }
    return engine, completions


# ------------------------------------------------------------------ the checker itself
def test_a_mixed_operation_names_the_cpu_tensor_and_the_line():
    with fake_cuda(), pytest.raises(DeviceMismatch) as raised:
        on_device = torch.ones(3, device="cuda:0")
        on_device + torch.arange(3)  # the planted CPU tensor
    message = str(raised.value)
    assert "add mixes cuda:0 (fake) tensors with cpu tensor [3] int64" in message
    assert "test_fake_cuda.py" in message and "on_device + torch.arange(3)" in message


def test_inside_the_check_real_cuda_is_not_available_even_on_a_gpu_machine(monkeypatch):
    """On a machine with a GPU, code asking for real CUDA kernels (FP8 matmuls) must hear no about the
    fake device's CPU tensors, as it does on a machine without one (seen on an H100: an FP8 matmul
    on fake CUDA tensors reached the CPU's kernel)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with fake_cuda():
        assert not torch.cuda.is_available()
        assert not weights_module.fp8_matmuls(CUDA)
    assert torch.cuda.is_available()


def test_transfers_are_legal_zero_dim_cpu_tensors_too_and_reads_are_counted():
    with fake_cuda() as check:
        x = torch.arange(4).to("cuda:0")
        x.copy_(torch.tensor([4, 5, 6, 7]))  # host to device: what copy_ is for
        y = x * torch.tensor(2)  # a 0-dim CPU tensor mixes with CUDA tensors on a GPU too
        assert isinstance(y, FakeCudaTensor) and y.device == CUDA
        assert y.tolist() == [8, 10, 12, 14]
        assert int(y[0]) == 8
        host = y.cpu()
        assert type(host) is torch.Tensor and host.device.type == "cpu"
        (y > 9).nonzero()
    kinds = sorted(site.split(" at ")[0] for site in check.syncs.elements())
    assert kinds == ["__int__", "cpu", "nonzero", "tolist"]
    assert torch.equal(real(y), torch.tensor([8, 10, 12, 14]))


def test_an_upload_does_not_wait_for_the_device_and_is_free_on_the_cpu():
    from everyprompt.devices.placement import upload

    host = torch.arange(5)
    assert upload(host, torch.device("cpu")) is host
    with (
        fake_cuda() as check,
        torch.inference_mode(),
    ):  # the decode loop's mode, where `to` reaches the check whole
        blocking = host.to(CUDA)
        moved = upload(host, CUDA)
    assert isinstance(moved, FakeCudaTensor) and torch.equal(real(moved), host)
    assert sum(check.uploads.values()) == 1 and "blocking = host.to(CUDA)" in next(iter(check.uploads))
    assert torch.equal(real(blocking), host)


def test_a_module_moved_to_fake_cuda_trains_there():
    torch.manual_seed(0)
    reference = torch.nn.Linear(3, 2)
    with fake_cuda():
        module = torch.nn.Linear(3, 2)
        module.load_state_dict(reference.state_dict())
        module.to("cuda:0")
        assert all(isinstance(p, FakeCudaTensor) and p.device == CUDA for p in module.parameters())
        module(torch.ones(4, 3, device="cuda:0")).sum().backward()
        assert module.weight.grad.device == CUDA
        torch.optim.SGD(module.parameters(), lr=0.1).step()
        moved = real(module.weight.detach())
    reference(torch.ones(4, 3)).sum().backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    torch.testing.assert_close(moved, reference.weight.detach(), atol=0, rtol=0)


# ------------------------------------------------------------------ the native engine on it
@pytest.mark.long  # 40 s on 2 cores: `make test-long`
@pytest.mark.parametrize(
    "precision,params",
    [
        ("fp32", {}),
        ("fp32", {"record_routes": True, "record_router_logits": True}),
        ("fp8", {"record_routes": True}),
        pytest.param("fp8 matmuls", {"record_routes": True}, marks=needs_scaled_mm),
        ("fp32", {"greedy": True}),
    ],
    ids=["sampled", "routes", "fp8-routes", "fp8-matmuls-routes", "greedy"],
)
def test_a_rollout_on_fake_cuda_equals_the_cpu_one(tiny_model, precision, params):
    model, tokenizer = tiny_model
    _, expected = _generate(model, tokenizer, "cpu", precision, **params)
    with fake_cuda() as check:
        engine, got = _generate(model, tokenizer, "cuda:0", precision, **params)
        assert engine.lm_head.device == CUDA and engine.cache.views(1, 1)[0][0].device == CUDA
        check.syncs.clear()
        check.uploads.clear()
        got = {c.request_id: c for c in engine.generate(_requests(tokenizer), SamplingParams(16, **params))}
    for request_id, reference in expected.items():
        completion = got[request_id]
        assert completion.token_ids == reference.token_ids
        assert completion.logprobs.device.type == "cpu"  # completions leave the engine on the host
        torch.testing.assert_close(completion.logprobs, reference.logprobs, atol=1e-5, rtol=0)
        if reference.routed_experts is not None:
            assert torch.equal(completion.routed_experts, reference.routed_experts)
        if reference.router_logits is not None:
            torch.testing.assert_close(completion.router_logits, reference.router_logits, atol=1e-5, rtol=0)
    steps = engine.stats["decode_steps"]
    per_step = check.total_syncs / steps
    print(
        f"{precision} {params}: {check.total_syncs} host syncs over {steps:.0f} decode steps ({per_step:.2f})"
    )
    assert per_step < 2.0, check.syncs
    if not (params.get("record_routes") or params.get("record_router_logits")):
        # one read a step: its tokens with their log-probs and entropies; a finished row needs no read of
        # its own (only recorded routes are read when a row finishes)
        assert check.total_syncs == steps, check.syncs
    # and no upload waits for the device (the prompts, the rows' indices as they finish and the pool shrinks)
    assert not check.uploads, dict(check.uploads)


# ------------------------------------------------------------------ planted CPU tensors are named
def _plant_decode_mask(monkeypatch):
    def bias(positions, width, dtype, mask_layout):  # the mask built on the CPU, as the engine once did
        visible = torch.arange(width)[None, :] <= positions[:, None]
        return torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))

    monkeypatch.setattr(engine_module, "decode_bias", bias)
    return "visible = torch.arange(width)[None, :] <= positions[:, None]"


def _plant_route_buffer(monkeypatch):
    start = rows_module.Record.start.__func__

    def on_host(cls, engine, params, slots, width):
        record = start(cls, engine, params, slots, width)
        record.routes = real(record.routes).clone()  # the replay buffer left on the host
        return record

    monkeypatch.setattr(rows_module.Record, "start", classmethod(on_host))
    return "buffer[rows, columns] = values.to(buffer.dtype)"


def _plant_host_scales(monkeypatch, two_dimensional_only: bool = False) -> None:
    """FP8 scales left on the host (of every weight, or of the 2-D ones: the attention projections,
    which FP8 matmuls multiply; the experts are dequantised either way)."""
    quantize = weights_module.FP8Weight.quantize.__func__

    def host_scale(cls, weight, dtype=torch.float32):
        quantized = quantize(cls, weight, dtype)
        if weight.dim() == 2 or not two_dimensional_only:
            quantized.scale = real(quantized.scale).clone()
        return quantized

    monkeypatch.setattr(weights_module.FP8Weight, "quantize", classmethod(host_scale))


def _plant_fp8_scale(monkeypatch):
    _plant_host_scales(monkeypatch)
    return "return (self.data.float() * self.scale).to(self.dtype)"


def _plant_fp8_matmul_scale(monkeypatch):
    _plant_host_scales(monkeypatch, two_dimensional_only=True)
    return "out = torch._scaled_mm("


@pytest.mark.parametrize(
    "plant,precision,params",
    [
        (_plant_decode_mask, "fp32", {}),
        (_plant_route_buffer, "fp32", {"record_routes": True}),
        (_plant_fp8_scale, "fp8", {}),
        (_plant_fp8_matmul_scale, "fp8 matmuls", {}),
    ],
    ids=["engine-mask", "replay-routes", "fp8-scales", "fp8-matmul-scales"],
)
def test_a_cpu_tensor_planted_in_a_path_is_named(tiny_model, monkeypatch, plant, precision, params):
    model, tokenizer = tiny_model
    line = plant(monkeypatch)
    with fake_cuda(), pytest.raises(DeviceMismatch) as raised:
        _generate(model, tokenizer, "cuda:0", precision, **params)
    assert line in str(raised.value) and "cpu tensor" in str(raised.value)


# ------------------------------------------------------------------ the hf engine on it
@pytest.mark.long  # 7 s on 2 cores: `make test-long`
@pytest.mark.parametrize("params", [{}, {"record_routes": True, "greedy": True}], ids=["sampled", "routes"])
def test_an_hf_engine_rollout_on_fake_cuda_equals_the_cpu_one(params):
    model, tokenizer = make_tiny_model()
    use_sorted_experts(model)  # transformers' own experts kernel takes CUDA-only branches on (fake) cuda
    sampling = SamplingParams(12, **params)
    expected = {
        c.request_id: c
        for c in HFEngine.from_model(model, tokenizer, 4).generate(_requests(tokenizer), sampling)
    }
    with fake_cuda() as check:
        engine = HFEngine.from_model(model, tokenizer, 4, device="cuda:0")
        assert all(isinstance(p, FakeCudaTensor) for p in engine.model.parameters())
        got = {c.request_id: c for c in engine.generate(_requests(tokenizer), sampling)}
    for request_id, reference in expected.items():
        completion = got[request_id]
        assert completion.token_ids == reference.token_ids
        torch.testing.assert_close(completion.logprobs, reference.logprobs, atol=1e-5, rtol=0)
        if reference.routed_experts is not None:
            assert completion.routed_experts.device.type == "cpu"
            assert torch.equal(completion.routed_experts, reference.routed_experts)
    steps = engine.stats["decode_steps"] + 1  # the steps sampling after each forward
    own = sum(count for line, count in check.syncs.items() if " at src/everyprompt/" in line)
    print(f"hf engine {params}: {check.total_syncs} host syncs over {steps:.0f} steps, {own} in its own code")
    # its own: one read of the sampled tokens a step and one when rows leave; the rest is transformers'
    # check of the padding mask in every forward (masking_utils), as generate() pays it too
    assert own / steps < 1.5 and check.total_syncs / steps < 5, check.syncs
