"""Checks that wait for a GPU (`make test-gpu`, `pytest -m gpu`): collected everywhere, skipped where torch
sees no CUDA device. They passed on an H100 once (docs/gpu.md says what has run where)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from everyprompt.rollout import GenerationRequest, SamplingParams
from everyprompt.rollout.native import NativeEngine
from everyprompt.rollout.native.weights import fp8_matmuls
from everyprompt.trainer import Learner
from everyprompt.trainer.data_parallel import DataParallel
from everyprompt.trainer.logprobs import token_logprobs
from tests.conftest import make_tiny_model, tiny_config
from tests.rollout.test_fp8_matmul import fp8_comparison
from tests.trainer.test_data_parallel import REWARDS, SETTINGS, _free_port, _train
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


def _nccl_rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        config = tiny_config(*SETTINGS)
        model, tokenizer = _model(config)
        learner = Learner(config, model.to(f"cuda:{rank}"), tokenizer.pad_token_id, parallel=DataParallel())
        for rewards in REWARDS:
            learner.update(hand_batch(_model(config)[0], tokenizer, rewards))
        if rank == 0:
            torch.save({k: v.cpu() for k, v in learner.state_dict().items()}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_nccl_ranks_update_as_one_process(tmp_path):
    weights, _, _ = _train("ddp")  # one process, on the CPU
    out = str(tmp_path / "rank0.pt")
    mp.spawn(_nccl_rank, args=(2, _free_port(), out), nprocs=2, join=True)
    ranks = torch.load(out)
    for key, value in weights.items():
        torch.testing.assert_close(ranks[key], value, rtol=0, atol=1e-4, msg=key)


def test_the_throughput_bench_on_cuda(tmp_path):
    from tests.test_bench import _load, _saved_tiny_model

    bench = _load("throughput")
    model = _saved_tiny_model(tmp_path / "tiny")
    args = ["--model", str(model), "--quick", "--device", "cuda", "--dtype", "bf16", "--out", str(tmp_path)]
    assert bench.main(args) == 0
    payload = json.loads((tmp_path / "throughput_tiny_cuda.json").read_text())
    assert payload["device"] == "cuda:0" and all(row["floor_ms"] > 0 for row in payload["decode"])
