"""What a Ray run's checkpoint brings from its learner ranks to the driver: nothing of the weights (rank 0
writes a full fine-tuning's, a LoRA policy's adapter and merged model) and nothing of the optimizer state
(each rank writes its share into the checkpoint)."""

from __future__ import annotations

import pytest
import torch

from everyprompt.distributed.buckets import readable
from everyprompt.distributed.learner import RankedLearner
from everyprompt.models.io import load_pretrained
from everyprompt.models.lora import apply_lora
from everyprompt.trainer import Learner
from everyprompt.trainer.checkpoint import SHARDED, SHARDS, CheckpointError
from tests.conftest import tiny_config
from tests.distributed.test_ray_training import LORA, SETTINGS
from tests.trainer.test_sides import _model, hand_batch


def _two_ranks(sharding: str):
    """Two Ray learner ranks of a full fine-tuning: (config, learner, tokenizer)."""
    config = tiny_config(*SETTINGS, "cluster.backend=ray", "cluster.trainer_ranks=2")
    config.cluster.trainer_sharding = sharding
    model, tokenizer = _model(config)
    return config, RankedLearner(config, model, tokenizer.pad_token_id), tokenizer


def _update(learner, config, tokenizer) -> None:
    learner.update(hand_batch(_model(config)[0], tokenizer, [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]))


@pytest.mark.long  # two Ray learners start: tens of seconds
@pytest.mark.parametrize("sharding", ["ddp", "fsdp2"])
def test_each_rank_writes_its_share_of_the_optimizer_state_and_one_process_reads_it_whole(
    ray_instance, tmp_path, sharding
):
    config, learner, tokenizer = _two_ranks(sharding)
    try:
        assert learner.training_state(tmp_path)["optimizer"] == {}  # before any step: nothing to write
        _update(learner, config, tokenizer)
        state = learner.training_state(tmp_path)
        whole = learner.training_state()  # the same state gathered to rank 0 and sent here
    finally:
        learner.close()
    assert state["optimizer"] == {SHARDED: SHARDS}  # nothing of it came through Ray
    written = {p.name for p in (tmp_path / SHARDS).iterdir()}
    assert {"__0_0.distcp", ".metadata"} <= written
    assert sharding == "ddp" or "__1_0.distcp" in written  # fsdp2: each rank holds (and writes) half
    assert state["version"] == whole["version"] == 1
    # one process, no group, reads the ranks' shares as the whole state
    local = Learner(tiny_config(*SETTINGS), _model(config)[0], tokenizer.pad_token_id)
    local.load_training_state({**state, "optimizer": {SHARDED: str(tmp_path / SHARDS)}})
    read = local.training_state()["optimizer"]
    assert read["param_groups"] == whole["optimizer"]["param_groups"]
    assert read["state"].keys() == whole["optimizer"]["state"].keys()
    for name, values in whole["optimizer"]["state"].items():
        for key, value in values.items():
            assert torch.equal(read["state"][name][key], value), (name, key)


def test_a_share_written_where_the_driver_cannot_see_it_fails_the_checkpoint(tmp_path):
    learner = object.__new__(RankedLearner)  # what the ranks answer, without starting them
    learner._all = lambda refs, what: [({"version": 1}, ["__0_0.distcp"]), ({}, ["__1_0.distcp"])]
    learner.ranks = [type("Rank", (), {"training_state": type("Call", (), {"remote": lambda *a: None})})]
    (tmp_path / SHARDS).mkdir()
    (tmp_path / SHARDS / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(
        CheckpointError, match=r"learner rank 1 wrote __1_0\.distcp into .*storage every node"
    ):
        learner.training_state(tmp_path)
    (tmp_path / SHARDS / "__1_0.distcp").write_bytes(b"")
    assert learner.training_state(tmp_path) == {"version": 1}


def test_missing_shards_are_named(tmp_path):
    config = tiny_config(*SETTINGS)
    model, tokenizer = _model(config)
    local = Learner(config, model, tokenizer.pad_token_id)
    state = {**local.training_state(), "optimizer": {SHARDED: str(tmp_path / SHARDS)}}
    with pytest.raises(CheckpointError, match=r"learner_shards: the learner's optimizer shards are missing"):
        local.load_training_state(state)


@pytest.mark.long  # two Ray learners start: tens of seconds
@pytest.mark.parametrize("sharding", ["ddp", "fsdp2"])
def test_rank_0_writes_a_full_fine_tunings_weights_and_nothing_comes_to_the_driver(
    ray_instance, tmp_path, sharding
):
    config, learner, tokenizer = _two_ranks(sharding)
    before = _model(config)[0].state_dict()  # the starting weights
    try:
        _update(learner, config, tokenizer)
        learner.save_model(None, tokenizer, tmp_path)  # the driver's copy is not read
        ranks = learner._all([r.model_weights.remote() for r in learner.ranks], "checkpoint")[0]
    finally:
        learner.close()
    written = {path.name for path in tmp_path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= written
    saved, loaded_tokenizer = load_pretrained(tmp_path)
    assert loaded_tokenizer.pad_token_id == tokenizer.pad_token_id
    saved = saved.state_dict()
    assert saved.keys() == ranks.keys()
    assert sum(not torch.equal(saved[k], before[k]) for k in saved) > len(saved) // 2  # the update's
    assert all(torch.equal(saved[name], ranks[name]) for name in ranks)


@pytest.mark.long  # two Ray learners start: tens of seconds
@pytest.mark.parametrize("sharding", ["ddp", "fsdp2"])
def test_rank_0_writes_a_lora_policys_adapter_and_merged_model(ray_instance, tmp_path, sharding):
    from safetensors.torch import load_file

    config = tiny_config(*SETTINGS, *LORA, "cluster.backend=ray", "cluster.trainer_ranks=2")
    config.cluster.trainer_sharding = sharding
    model, tokenizer = _model(config)
    learner = RankedLearner(config, apply_lora(model, config.model.lora), tokenizer.pad_token_id)
    try:
        _update(learner, config, tokenizer)
        learner.save_model(None, tokenizer, tmp_path, merged=True)  # the driver's copy is not read
        ranks = learner._all([r.model_weights.remote() for r in learner.ranks], "checkpoint")[0]
        engine = dict(readable(learner.state_dict(), ray_instance.get))  # the merged weights, as synced
    finally:
        learner.close()
    adapter = load_file(tmp_path / "adapter_model.safetensors")  # peft's names, without the adapter's
    trained = {name.replace(".default", ""): value for name, value in ranks.items() if "lora_" in name}
    assert adapter.keys() == trained.keys() and trained
    assert all(torch.equal(adapter[name], value) for name, value in trained.items())
    assert (tmp_path / "adapter_config.json").is_file() and (
        tmp_path / "merged" / "tokenizer_config.json"
    ).is_file()
    merged = load_pretrained(tmp_path / "merged")[0].state_dict()
    assert merged.keys() == engine.keys()
    assert all(torch.equal(merged[name], engine[name]) for name in engine)
