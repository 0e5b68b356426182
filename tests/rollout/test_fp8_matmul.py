"""FP8 matmuls (`FP8Weight.matmul`, torch._scaled_mm) against the weight-only FP8 reference: the engine
takes them on CUDA devices of compute capability 9.0+, and wherever torch can run `_scaled_mm` (this CPU,
if its build has the kernel) the two are compared here."""

import pytest
import torch

from everyprompt.rollout import GenerationRequest, SamplingParams
from everyprompt.rollout.native import NativeEngine
from everyprompt.rollout.native.weights import FP8Weight, fp8_matmuls, linear
from tests.conftest import make_tiny_model


def _scaled_mm_runs_here() -> bool:
    try:
        a = torch.ones(16, 16).to(torch.float8_e4m3fn)
        torch._scaled_mm(
            a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16
        )
    except (RuntimeError, NotImplementedError):
        return False
    return True


needs_scaled_mm = pytest.mark.skipif(
    not _scaled_mm_runs_here(), reason="torch._scaled_mm with per-row scales has no kernel on this device"
)


def test_fp8_matmuls_are_chosen_by_device():
    assert not fp8_matmuls(torch.device("cpu"))  # the CPU keeps the weight-only reference path


@needs_scaled_mm
def test_an_fp8_matmul_agrees_with_the_dequantised_product_within_fp8_precision():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 32, generator=generator)  # [out, in]
    x = torch.randn(5, 7, 32, generator=generator)
    quantized = FP8Weight.quantize(weight)
    reference = x @ quantized.operand()  # weight-only: the dequantised weight, x unrounded
    got = linear(x, quantized)
    assert got.shape == reference.shape == (5, 7, 64)
    # e4m3 keeps 3 mantissa bits: x's rounding adds a relative error of about 2^-4 per product, which
    # averages down over the 32-term sums
    error = (got - reference).abs().max() / reference.abs().max()
    assert 0 < error < 0.05, float(error)


def test_a_weight_with_sides_off_the_kernels_tiles_is_multiplied_dequantised():
    weight = FP8Weight.quantize(torch.randn(10, 6))
    x = torch.randn(3, 6)
    torch.testing.assert_close(linear(x, weight), x @ weight.operand(), atol=0, rtol=0)


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def fp8_comparison(device: torch.device | str = "cpu") -> dict[str, tuple[float, float]]:
    """The tiny model's greedy rollouts (16 tokens, six prompts) in fp32, fp8 weight-only and with FP8
    matmuls on `device`: per comparison, (mean shared greedy prefix, max |dlogp| on it)."""
    model, tokenizer = make_tiny_model()
    prompts = ["37+48=", "1+2=", "123+456+789=", "9=", "5+5+5=", "800+1="]
    requests = [GenerationRequest(i, tokenizer(p).input_ids, seed=i) for i, p in enumerate(prompts)]
    params = SamplingParams(16, greedy=True)
    runs = {}
    for name, precision, fp8_matmul in (
        ("fp32", "fp32", None),
        ("fp8", "fp8", False),
        ("fp8 matmuls", "fp8", True),
    ):
        engine = NativeEngine.from_model(model, tokenizer, 4, precision, device=device, fp8_matmul=fp8_matmul)
        assert engine.fp8_matmul is bool(fp8_matmul)
        runs[name] = {c.request_id: c for c in engine.generate(requests, params)}

    def compare(a: str, b: str) -> tuple[float, float]:
        prefixes, gaps = [], [0.0]
        for request_id, first in runs[a].items():
            second = runs[b][request_id]
            shared = _shared_prefix(first.token_ids, second.token_ids)
            prefixes.append(shared)
            if shared:
                gaps.append(float((first.logprobs[:shared] - second.logprobs[:shared]).abs().max()))
        return sum(prefixes) / len(prefixes), max(gaps)

    return {
        "fp8 weights vs fp32": compare("fp32", "fp8"),
        "fp8 matmuls vs fp8 weights": compare("fp8", "fp8 matmuls"),
    }


@needs_scaled_mm
def test_an_fp8_rollout_with_fp8_matmuls_moves_no_further_than_fp8_weights_do():
    """A random tiny model's greedy choices are near-ties, so any rounding flips some of them (weight-only
    FP8 against fp32 agrees on 2.5 tokens of 16 on average). The check: FP8 matmuls move the rollout no
    further from the weight-only reference than weight-only FP8 moves it from fp32, measured by the shared
    greedy prefix, and the log-probs on the shared prefix differ by at most what FP8 rounding gives."""
    found = fp8_comparison()
    (weight_prefix, weight_gap), (matmul_prefix, matmul_gap) = found.values()
    print(f"shared greedy prefix and max |dlogp| on it: {found}")
    assert matmul_prefix >= weight_prefix
    assert 0 < matmul_gap <= max(weight_gap, 0.25)
