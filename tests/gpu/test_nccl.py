"""Checks of the learner's process group on CUDA (`make test-gpu`): NCCL ranks, fsdp2 over NCCL, and its
optimizer state written as a checkpoint's shards over NCCL.
Collected everywhere, skipped where torch sees no CUDA device."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from everyprompt.trainer import Learner
from everyprompt.trainer.learner_side.data_parallel import DataParallel
from tests.conftest import tiny_config
from tests.trainer.test_data_parallel import REWARDS, SETTINGS, _free_port, _train
from tests.trainer.test_sides import _model, hand_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch sees none here"),
]
CUDA = torch.device("cuda", 0)


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


def _nccl_gather(rank: int, port: int, out: str) -> None:
    """One NCCL rank (a group of one still gathers through NCCL): a LoRA policy on a bf16 base, sharded."""
    from everyprompt.models.gathering import gathered_weights
    from everyprompt.models.lora import merged_state_dict
    from everyprompt.models.slices import checked_layers, model_slice
    from tests.models.test_lora import adapted_policy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=1)
    try:
        torch.manual_seed(0)
        policy, tokenizer = adapted_policy(torch.bfloat16)
        expected = {k: v.clone() for k, v in merged_state_dict(policy).items()}
        sliced_expected = model_slice(policy, 1).state_dict()
        sharded = DataParallel("fsdp2").shard(policy.to(CUDA))
        got = dict(gathered_weights(sharded, keep=True))
        layers = checked_layers("auto", sharded)
        sliced = {k: v.cpu() for k, v in model_slice(sharded, 1).state_dict().items()}
        ids = torch.tensor([tokenizer("12+34=").input_ids], device=CUDA)
        sharded(ids).logits.float().sum().backward()  # a bf16 base, float32 adapters: one backward
        grads = [p.grad is not None for p in sharded.parameters() if p.requires_grad]
        torch.save(
            {
                "expected": expected,
                "got": got,
                "layers": layers,
                "sliced": sliced,
                "sliced_expected": sliced_expected,
                "grads": grads,
            },
            out,
        )
    finally:
        dist.destroy_process_group()


def test_a_sharded_policy_on_a_bf16_base_gathers_and_trains_over_nccl(tmp_path):
    """fsdp2 on a bf16 base with float32 adapters (gathered as bytes) over NCCL: the weight sync's layer
    gather gives the merged weights, the learner's check copy its float32 slice, and a backward fills the
    adapters' gradients."""
    out = str(tmp_path / "gathered.pt")
    mp.spawn(_nccl_gather, args=(_free_port(), out), nprocs=1, join=True)
    result = torch.load(out)
    expected, got = result["expected"], result["got"]
    assert set(got) == set(expected)
    for key, value in expected.items():  # adapted weights merged by the GPU's matmul, the CPU's here
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-4, msg=key)
    assert result["layers"] is not None  # a narrow sharded model: checked on a float32 copy
    for key, value in result["sliced_expected"].items():
        torch.testing.assert_close(result["sliced"][key], value, rtol=0, atol=1e-4, msg=key)
    assert result["grads"] and all(result["grads"])


def _shard_rank(rank: int, port: int, out: str, backend: str = "nccl", device: str = "cuda") -> None:
    """One rank of a group (NCCL on CUDA; gloo on the CPU when tried without a GPU): a sharded learner's
    update on the device with its AdamW (fused on CUDA), then its optimizer state written as shards, as a
    Ray rank writes it into a checkpoint, and also whole, and its weights saved by rank 0 as a checkpoint's."""
    from everyprompt.trainer.checkpoint import SHARDS, full_weights, portable_optimizer_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=1)
    try:
        config = tiny_config(*SETTINGS)
        model, tokenizer = _model(config)
        learner = Learner(config, model.to(device), tokenizer.pad_token_id, parallel=DataParallel("fsdp2"))
        learner.update(hand_batch(_model(config)[0], tokenizer, REWARDS[0]))
        state = learner.training_state(Path(out))
        whole = portable_optimizer_state(learner.model, learner.optimization.optimizer, sharded=True)
        learner.model.save_pretrained(Path(out) / "model", state_dict=full_weights(learner.model))
        torch.save({"state": state, "whole": whole, "shards": str(Path(out) / SHARDS)}, Path(out) / "rank.pt")
    finally:
        dist.destroy_process_group()


def test_a_ranks_optimizer_shards_written_over_nccl_load_whole_on_the_cpu(tmp_path):
    """What a Ray learner rank on a GPU writes into a checkpoint (torch.distributed.checkpoint over NCCL,
    the fused AdamW's state on the device) reads back in one CPU process as the whole state it gathers."""
    from everyprompt.models.io import load_pretrained
    from everyprompt.trainer.checkpoint import SHARDED

    mp.spawn(_shard_rank, args=(_free_port(), str(tmp_path)), nprocs=1, join=True)
    written = torch.load(tmp_path / "rank.pt")
    assert written["state"]["optimizer"] == {SHARDED: "learner_shards"}
    config = tiny_config(*SETTINGS)
    model, tokenizer = _model(config)
    local = Learner(config, model, tokenizer.pad_token_id)
    local.load_training_state({**written["state"], "optimizer": {SHARDED: written["shards"]}})
    read, whole = local.training_state()["optimizer"], written["whole"]
    assert read["state"].keys() == whole["state"].keys()
    for name, values in whole["state"].items():
        for key, value in values.items():
            assert torch.equal(read["state"][name][key].cpu(), value.cpu()), (name, key)
    saved = load_pretrained(tmp_path / "model")[0].state_dict()
    assert saved.keys() == model.state_dict().keys()
