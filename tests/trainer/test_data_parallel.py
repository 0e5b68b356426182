"""A data-parallel learner (2 gloo processes) takes the single process's updates: ddp and fsdp2."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from everyprompt.trainer import Learner
from everyprompt.trainer.learner_side.data_parallel import DataParallel
from tests.conftest import tiny_config
from tests.trainer.test_sides import _model, hand_batch

# three steps with different rewards; 6 rows in micro-batches of 2, two mini-batches of 3 rows: ranks get
# unequal shares (2 + 1 micro-batches), r2 replays the old pass's routes, k3 KL against a frozen copy
SETTINGS = (
    "rl.old_logprobs=recompute",
    "rl.mini_batches=2",
    "rl.micro_batch_size=2",
    "rl.router_replay=r2",
    "rl.kl.estimator=k3",
    "rl.kl.coef=0.1",
    "rl.lr=1e-2",
)
REWARDS = ([1.0, 0.0, 1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 1.0, 1.0, 0.0])


def _train(sharding: str, extra: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], list[dict], dict]:
    """Three updates; the final weights (whole), each update's metrics, and the training state."""
    config = tiny_config(*SETTINGS, *extra)
    model, tokenizer = _model(config)
    learner = Learner(config, model, tokenizer.pad_token_id, parallel=DataParallel(sharding))
    history = []
    for rewards in REWARDS:
        reference, _ = _model(config)  # the batch's "engine" log-probs: the same each rank
        history.append(learner.update(hand_batch(reference, tokenizer, rewards)))
    return learner.state_dict(), history, learner.training_state()


def _rank(rank: int, world: int, port: int, sharding: str, out: str, extra: tuple[str, ...] = ()) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        weights, history, state = _train(sharding, extra)
        if rank == 0:
            torch.save({"weights": weights, "history": history, "state": state}, out)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.long  # tens of seconds: `make test-long` (.ci/run runs it after `make test`)
@pytest.mark.parametrize(
    ("sharding", "extra"),
    [
        ("ddp", ()),
        ("fsdp2", ()),
        # micro-batches cut by tokens (a cap below every row: one row a pass), the ranks' counts unequal
        ("fsdp2", ("rl.micro_batch_size=auto", "rl.micro_batch_tokens=1")),
    ],
    ids=["ddp", "fsdp2", "fsdp2-by-tokens"],
)
def test_two_ranks_update_as_one_process(tmp_path, sharding, extra):
    torch.set_num_threads(1)
    weights, history, state = _train(sharding, extra)  # no process group here: one process
    out = str(tmp_path / "rank0.pt")
    mp.spawn(_rank, args=(2, _free_port(), sharding, out, extra), nprocs=2, join=True)
    ranks = torch.load(out, weights_only=False)
    assert ranks["weights"].keys() == weights.keys()
    changed = 0
    for key, value in weights.items():
        torch.testing.assert_close(ranks["weights"][key], value, rtol=0, atol=1e-5, msg=key)
        changed += not torch.equal(value, _model(tiny_config(*SETTINGS))[0].state_dict()[key])
    assert changed > len(weights) // 2  # the updates moved most tensors: the comparison is not vacuous
    for mine, theirs in zip(history, ranks["history"]):
        for key in ("loss/policy", "actor/grad_norm", "actor/entropy", "mismatch/logp_abs_diff"):
            assert theirs[key] == pytest.approx(mine[key], rel=1e-4, abs=1e-6), key
    # the optimizer state is keyed by name and whole either way: it resumes on any rank count
    assert ranks["state"]["optimizer"]["state"].keys() == state["optimizer"]["state"].keys()
    for name, moments in state["optimizer"]["state"].items():
        torch.testing.assert_close(
            ranks["state"]["optimizer"]["state"][name]["exp_avg"], moments["exp_avg"], rtol=0, atol=1e-5
        )


def _group(world: int, rank: int, sharding: str = "ddp") -> DataParallel:
    """A `DataParallel` that believes it is `rank` of `world` (micro-batching reads no collective)."""
    group = DataParallel(sharding)
    group.distributed, group.world, group.rank = world > 1, world, rank
    return group


def test_micro_batches_are_cut_by_count_and_by_tokens():
    one = _group(1, 0)
    rows = [10, 11, 12, 13, 14]
    assert [chunk for _, chunk in one.micro_batches(rows, 2)] == [[10, 11], [12, 13], [14]]
    lengths = [5, 5, 5, 12, 3]
    # 5 + 5 fit 10 tokens; 5 + 12 do not; the 12-token row goes alone; 12 + 3 do not fit either
    by_tokens = one.micro_batches(rows, None, 10, lengths)
    assert [chunk for _, chunk in by_tokens] == [[10, 11], [12], [13], [14]]
    assert [key for key, _ in by_tokens] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    # both caps: whichever is reached first
    assert [chunk for _, chunk in one.micro_batches(rows, 2, 100, lengths)] == [[10, 11], [12, 13], [14]]
    assert [chunk for _, chunk in one.micro_batches(rows, None, 100, lengths)] == [rows]
    with pytest.raises(ValueError, match="length"):
        one.micro_batches(rows, None, 10)


def test_sharded_ranks_run_as_many_passes_as_the_busiest_when_cut_by_tokens():
    rows, lengths = [0, 1, 2, 3, 4], [1, 1, 1, 9, 9]  # rank 0: rows 0-2 (3 tokens), rank 1: rows 3-4
    first = _group(2, 0, "fsdp2").micro_batches(rows, None, 10, lengths)
    second = _group(2, 1, "fsdp2").micro_batches(rows, None, 10, lengths)
    assert first == [((0, 0), [0, 1, 2]), ((0, 1), None)]  # a zero-weighted pass keeps it in step
    assert second == [((1, 0), [3]), ((1, 1), [4])]
    # ddp runs no padding passes
    assert _group(2, 0).micro_batches(rows, None, 10, lengths) == [((0, 0), [0, 1, 2])]
