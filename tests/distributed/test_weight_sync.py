"""A Ray run's weight sync: to bf16 engines it is sent in bf16 (`cluster.sync_dtype=engine`), half the bytes
of the float32 learner's weights, and the worker's engine samples what it would have from them; a pipelined
sync whose sender fails leaves no worker waiting."""

from __future__ import annotations

import time

import pytest
import torch

from everyprompt.data.passrate import PassRateStore
from everyprompt.distributed.backend import ray_sides
from everyprompt.distributed.buckets import WeightStream, packed_buckets
from everyprompt.distributed.rollout import RayEngine
from everyprompt.rollout import GenerationRequest, SamplingParams, build_engine
from tests.conftest import tiny_config
from tests.distributed.test_ray_training import SETTINGS
from tests.trainer.test_sides import _model, hand_batch

PROMPTS = [{"prompt": f"{a}+{a + 3}=", "answer": str(2 * a + 3), "level": 1} for a in range(1, 9)]


def _completions(engine, tokenizer) -> dict:
    requests = [GenerationRequest(i, tokenizer(p["prompt"]).input_ids, seed=i) for i, p in enumerate(PROMPTS)]
    return {c.request_id: c for c in engine.generate(requests, SamplingParams(8, temperature=1.0))}


@pytest.mark.long  # a learner rank and a rollout worker start: tens of seconds
@pytest.mark.parametrize("sync_dtype", ["engine", "learner"])
def test_bf16_engines_are_sent_bf16_weights_and_sample_as_from_float32(ray_instance, tmp_path, sync_dtype):
    config = tiny_config(
        *SETTINGS,
        "cluster.backend=ray",
        "rollout.precision=bf16",
        "rl.old_logprobs=recompute",
        f"cluster.sync_dtype={sync_dtype}",
    )
    model, tokenizer = _model(config)
    whole = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    rollout, learner, closers = ray_sides(config, model, tokenizer, PROMPTS, tmp_path, PassRateStore(), None)
    try:
        learner.update(hand_batch(_model(config)[0], tokenizer, [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]))
        handle = learner.state_dict()
        if sync_dtype == "learner":  # as the learner holds them: float32
            assert learner.last_sync_bytes == whole
            return
        assert learner.last_sync_bytes == whole // 2  # every weight of this model held in bf16
        rollout.load_weights(handle, 1)
        # the same update's float32 weights, loaded by a local bf16 engine
        trained = learner._all([r.model_weights.remote() for r in learner.ranks], "checkpoint")[0]
        local = build_engine(config.rollout, model, tokenizer)
        local.load_weights(trained)
        mine, theirs = _completions(local, tokenizer), _completions(rollout.engine, tokenizer)
        assert all(mine[i].token_ids == theirs[i].token_ids for i in mine)
        assert all(torch.equal(mine[i].logprobs, theirs[i].logprobs) for i in mine)
    finally:
        while closers:
            closers.pop()()


@pytest.mark.long  # two rollout workers start: tens of seconds
def test_a_pipelined_sync_whose_sender_fails_leaves_no_worker_waiting(ray_instance):
    """The learner fails after its first bucket: the error reaches the caller, each worker is told and
    ends its load (none is left waiting for buckets that will not come), and the next sync works."""
    config = tiny_config(*SETTINGS, "cluster.backend=ray", "cluster.rollout_workers=2")
    model, tokenizer = _model(config)
    engine = RayEngine(config, model, tokenizer)
    try:

        def failing():
            bucket, names, nbytes = next(packed_buckets(model.state_dict().items(), 1 << 12))
            yield ray_instance.put(bucket), names, nbytes
            raise RuntimeError("rank 0 fell over")

        with pytest.raises(RuntimeError, match="rank 0 fell over"):
            engine.load_weights(WeightStream(failing()))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            open_syncs = ray_instance.get(
                [w.__ray_call__.remote(lambda w: len(w._syncs)) for w in engine.workers]
            )
            if open_syncs == [0, 0]:
                break
            time.sleep(0.2)
        assert open_syncs == [0, 0]
        # a whole sync after it: the workers decode as a local engine with the same weights
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.mul_(0.9)
        engine.load_weights(model.state_dict())
        local = build_engine(config.rollout, model, tokenizer)
        mine, theirs = _completions(local, tokenizer), _completions(engine, tokenizer)
        assert all(mine[i].token_ids == theirs[i].token_ids for i in mine)
    finally:
        engine.close()
