"""Rollout workers as Ray actors make the local backend's batch, even when one dies mid-step."""

from __future__ import annotations

import pytest
import torch

from everyprompt.data.passrate import PassRateStore
from everyprompt.distributed.rollout import RayEngine
from everyprompt.rewards.pool import RewardPool
from everyprompt.rollout import build_engine, offers
from everyprompt.trainer import LocalRolloutSide
from tests.conftest import tiny_config
from tests.distributed.conftest import actors_left
from tests.trainer.test_sides import _model

SETTINGS = (
    "rl.prompts_per_step=8",
    "rl.group_size=4",
    "rollout.max_new_tokens=12",
    "rollout.batch_size=2",  # few slots: a worker is still decoding when its first completion returns
    "cluster.num_cpus=0.5",
)


def _reward(completions, **_):
    return [float(len(text) % 2) for text in completions]


def _side(config, engine, model, tokenizer) -> LocalRolloutSide:
    prompts = [{"prompt": f"{a}+{a + 3}=", "answer": str(2 * a + 3), "level": 1} for a in range(1, 20)]
    return LocalRolloutSide(
        config, engine, tokenizer, prompts, RewardPool(_reward, workers=0), PassRateStore()
    )


def _assert_same_batch(mine, theirs) -> None:
    assert theirs.completion_ids == mine.completion_ids and theirs.prompt_index == mine.prompt_index
    assert torch.equal(theirs.rewards, mine.rewards) and theirs.finish_reason == mine.finish_reason
    for a, b in zip(mine.rollout_logprobs, theirs.rollout_logprobs):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    for a, b in zip(mine.routed_experts, theirs.routed_experts):
        assert torch.equal(a, b)


@pytest.mark.long  # tens of seconds: `make test-long` (.ci/run runs it after `make test`)
@pytest.mark.parametrize("precision", ["fp32", pytest.param("fp8", marks=pytest.mark.slow)])
def test_two_rollout_workers_make_the_local_batch(ray_instance, precision):
    """fp8: each worker quantises the weights it is sent, as the local engine does."""
    config = tiny_config(
        *SETTINGS,
        "cluster.backend=ray",
        "cluster.rollout_workers=2",
        f"rollout.precision={precision}",
        "rl.old_logprobs=recompute",  # the engine's fp8 log-probs cannot stand for the old policy's
    )
    model, tokenizer = _model(config)
    local = _side(config, build_engine(config.rollout, model, tokenizer), model, tokenizer)
    engine = RayEngine(config, model, tokenizer)
    try:
        remote = _side(config, engine, model, tokenizer)
        for step in range(2):
            mine, theirs = local.next_batch(step), remote.next_batch(step)
            _assert_same_batch(mine, theirs)
            assert theirs.stats["cluster/actor_restarts"] == 0
        assert engine.stats["workers"] == 2 and engine.stats["tokens"] > 0
        # the workers take new weights as the local engine does
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(0.9)
        local.load_weights(model.state_dict(), 1)
        remote.load_weights(model.state_dict(), 1)
        _assert_same_batch(local.next_batch(2), remote.next_batch(2))
        # each worker's compile switch travels through a checkpoint (its own eager time: its own decoding)
        saved = remote.state_dict()["decode"]
        state = saved["state"]
        assert saved["engine"] == "RayEngine"
        assert [w["compile"]["mode"] for w in state["workers"]] == ["auto", "auto"]
        assert all(w["compile"]["eager_s"] > 0 for w in state["workers"])
        state["workers"][1]["compile"]["eager_s"] = 1e6  # as if its worker had decoded for days
        engine.load_decode_state(state)
        assert [w["compile"]["eager_s"] >= 1e6 for w in engine.decode_state()["workers"]] == [False, True]
    finally:
        engine.close()


@pytest.mark.long  # tens of seconds: `make test-long` (.ci/run runs it after `make test`)
def test_a_rollout_worker_killed_mid_step_is_replaced_and_its_requests_requeued(ray_instance):
    config = tiny_config(*SETTINGS, "cluster.backend=ray", "cluster.rollout_workers=2")
    model, tokenizer = _model(config)
    expected = _side(config, build_engine(config.rollout, model, tokenizer), model, tokenizer).next_batch(0)
    engine = RayEngine(config, model, tokenizer)
    try:
        victim = engine.workers[0]
        generate = engine.generate

        def killing(requests, params):
            for number, completion in enumerate(generate(requests, params)):
                if number == 0:
                    ray_instance.kill(victim)  # dies with most of its requests unfinished
                yield completion

        engine.generate = killing
        batch = _side(config, engine, model, tokenizer).next_batch(0)
        _assert_same_batch(expected, batch)
        assert batch.stats["cluster/actor_restarts"] == 1 and engine.restarts == 1
        assert engine.workers[0] is not victim
    finally:
        engine.close()
    assert actors_left("RolloutWorker") == []


@pytest.mark.long  # 12 s on 2 cores: `make test-long`
def test_workers_that_cannot_be_placed_fail_clearly(ray_instance):
    from everyprompt.distributed.runtime import RaySession
    from everyprompt.errors import ClusterError

    config = tiny_config("cluster.backend=ray", "cluster.rollout_workers=2", "cluster.num_cpus=4")
    with pytest.raises(ClusterError, match=r"has 2 CPUs.*2 actors at cluster.num_cpus=4.*need 8 CPU"):
        RaySession(config.cluster, actors=2)


@pytest.mark.slow  # about 35 s on 2 idle cores (two workers start); the local engine's episode tests run always
def test_rollout_workers_run_episodes_as_the_local_engine_does(ray_instance):
    """Each request's episode travels to its worker, is stepped there, and comes back in the completion:
    the batch (observations fed, masks, the environment's rewards) is the local engine's."""
    from tests.envs.test_env_runs import AnswerOnce

    config = tiny_config(
        *SETTINGS,
        "model.preset=tiny-chat-moe",
        "sft.steps=0",
        "env.name=test-answer-once",
        "rollout.max_new_tokens=24",
        "cluster.backend=ray",
        "cluster.rollout_workers=2",
    )
    model, tokenizer = _model(config)
    local = _side(config, build_engine(config.rollout, model, tokenizer), model, tokenizer)
    engine = RayEngine(config, model, tokenizer)
    try:
        assert offers(engine, "episodes")
        remote = _side(config, engine, model, tokenizer)
        mine, theirs = local.next_batch(0), remote.next_batch(0)
    finally:
        engine.close()
    _assert_same_batch(mine, theirs)
    assert mine.completion_mask is not None and theirs.completion_mask is not None
    assert any(not bool(m.all()) for m in mine.completion_mask)  # observations were fed
    for a, b in zip(mine.completion_mask, theirs.completion_mask):
        assert torch.equal(a, b)
    rewards = {round(r, 6) for r in theirs.rewards.tolist()}
    assert rewards <= {0.0, AnswerOnce.REWARD} and AnswerOnce.REWARD in rewards  # the environment's
