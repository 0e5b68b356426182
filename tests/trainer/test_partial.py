"""Partial rollouts (rollout.partial): sequences that span weight updates keep each token's version and
routes, the replay uses exactly those, the bound holds, in-flight prompts are neither drawn again nor
recorded twice, and a run resumes exactly with sequences in flight."""

from __future__ import annotations

import json

import pytest
import torch

from everyprompt.batch import RolloutBatch
from everyprompt.data.passrate import PassRateStore
from everyprompt.data.source import PromptSource
from everyprompt.models import load_model_and_tokenizer
from everyprompt.pipeline import train
from everyprompt.rollout import GenerationRequest, SamplingParams
from everyprompt.rollout.native import NativeEngine
from everyprompt.trainer import Learner
from everyprompt.trainer.learner_side.learner import Learner as LearnerClass
from everyprompt.trainer.rollout_side.partial import extend, tag
from tests.conftest import tiny_config

ASYNC = ["rl.old_logprobs=recompute", "rl.rollout_correction.mode=tis"]
SIGNAL = ["rewards.function=tests.trainer.flaky_reward:hashed", "rl.lr=1e-2", "rl.group_size=6"]
PARTIAL = ["rollout.partial=true", "rollout.partial_tokens=4"]  # the tiny model's samples run ~12 tokens


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


def _random_model(config, seed: int):
    model, tokenizer = load_model_and_tokenizer(config.model, config.seed)
    with torch.no_grad():  # larger weights than the init: routers pick distinct experts per token
        generator = torch.Generator().manual_seed(seed)
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model, tokenizer


def test_routes_are_replayed_token_by_token_across_a_version_boundary():
    config = tiny_config("rl.router_replay=r3", "model.pack_sequences=false", *ASYNC)
    old, tokenizer = _random_model(config, 1)  # policy version 0
    new, _ = _random_model(config, 2)  # policy version 1
    params = SamplingParams(12, record_routes=True)
    prompt = tokenizer("12+34=").input_ids
    first = next(
        iter(
            NativeEngine.from_model(old, tokenizer).generate(
                [GenerationRequest(0, prompt, seed=5, max_new_tokens=4)], params
            )
        )
    )
    assert first.finish_reason == "length" and len(first.token_ids) == 4
    engine = NativeEngine.from_model(new, tokenizer)
    more = next(iter(engine.generate([GenerationRequest(0, prompt + first.token_ids, seed=6)], params)))
    merged = extend(tag(first, 0), more, 1)

    fed = len(prompt) + 4 - 1  # the positions version 0 routed: the prompt and its first 3 tokens
    assert merged.versions.tolist() == [0] * 4 + [1] * len(more.token_ids)
    assert torch.equal(merged.routed_experts[:fed], first.routed_experts[:fed])
    assert torch.equal(merged.routed_experts[fed:], more.routed_experts[fed:])
    assert len(merged.routed_experts) == len(prompt) + len(merged.token_ids) - 1
    # version 1 routes the same prefix differently: taking its routes there would be wrong
    assert not torch.equal(more.routed_experts[:fed], first.routed_experts[:fed])

    batch = RolloutBatch(
        prompt_ids=[prompt],
        completion_ids=[merged.token_ids],
        rollout_logprobs=[merged.logprobs],
        finish_reason=[merged.finish_reason],
        group_index=torch.tensor([0]),
        prompt_index=[0],
        rewards=torch.tensor([1.0]),
        routed_experts=[merged.routed_experts],
        versions=[merged.versions],
    )
    learner = Learner(config, new, tokenizer.pad_token_id)  # the learner holds version 1
    replayed = []
    real_replay = learner.router.replay
    learner.router.replay = lambda indices: replayed.append(indices.clone()) or real_replay(indices)
    learner.old_logprobs(batch)
    (used,) = replayed
    used = used[used[:, 0, 0] >= 0][: len(merged.routed_experts)]
    for position, (given, taken) in enumerate(zip(merged.routed_experts, used)):  # token by token
        assert torch.equal(given.long().sort(-1).values, taken.long().sort(-1).values), position


def test_tokens_of_a_partial_sequence_stay_within_the_bound(tmp_path, monkeypatch):
    seen: list[tuple[int, list[torch.Tensor]]] = []
    update = LearnerClass.update

    def record(self, batch):
        seen.append((self.version, [v.clone() for v in batch.versions]))
        return update(self, batch)

    monkeypatch.setattr(LearnerClass, "update", record)
    train(tiny_config("rl.steps=5", "rl.max_staleness=1", *ASYNC, *SIGNAL, *PARTIAL), run_dir=tmp_path)
    spanning = 0
    for version, versions in seen:
        for row in versions:
            assert 0 <= version - int(row.max()) and version - int(row.min()) <= 2  # k + (versions - 1)
            spanning += int(row.min() != row.max())
    assert spanning > 0  # sequences did span a weight update
    rows = _metrics(tmp_path)
    assert max(row["async/staleness_max"] for row in rows) == 2.0
    assert sum(row["async/partial_sequences"] for row in rows) == spanning


def test_a_prompt_in_flight_is_neither_drawn_again_nor_recorded_twice(tmp_path, monkeypatch):
    from everyprompt.trainer.rollout_side import LocalRolloutSide

    in_flight_when_drawn: list[set[int]] = []
    recorded: list[int] = []
    take, record, next_batch = PromptSource.take, PassRateStore.record, LocalRolloutSide.next_batch
    sides: list = []

    refused: list[int] = []  # in-flight prompts the source came to and passed over

    def spy_take(self, count, mixture=None, available=None):
        busy = sides[0].partial.in_flight_prompts if sides else set()

        def watched(index):
            ok = available is None or available(index)
            if not ok and index in busy:
                refused.append(index)
            return ok

        drawn = take(self, count, mixture, watched)
        in_flight_when_drawn.append(set(drawn) & busy)
        return drawn

    def spy_record(self, visits, *args, **kwargs):
        recorded.append(len(visits))
        return record(self, visits, *args, **kwargs)

    def spy_batch(self, step):
        sides[:] = [self]
        batch = next_batch(self, step)
        spy_batch.groups += batch.num_groups
        return batch

    spy_batch.groups = 0
    monkeypatch.setattr(PromptSource, "take", spy_take)
    monkeypatch.setattr(PassRateStore, "record", spy_record)
    monkeypatch.setattr(LocalRolloutSide, "next_batch", spy_batch)
    # 9 RL prompts, 3 a step, groups in flight for two steps: the source comes round to busy prompts
    overrides = ["rl.steps=6", "data.num_train=24", "rl.prompts_per_step=3", "zve.enabled=true"]
    overrides.append("rollout.max_versions_per_sequence=3")
    train(tiny_config(*overrides, *ASYNC, *SIGNAL, *PARTIAL, "zve.expansion.enabled=false"), run_dir=tmp_path)
    assert in_flight_when_drawn and not any(in_flight_when_drawn) and refused
    # every finished group recorded once, when it finished: as many visits as groups trained on
    assert sum(recorded) == spy_batch.groups


@pytest.mark.long  # 6 s on 2 cores: `make test-long`
def test_a_resumed_run_with_sequences_in_flight_equals_an_uninterrupted_one(tmp_path, monkeypatch):
    overrides = ["rl.steps=4", "rl.max_staleness=1", *ASYNC, *SIGNAL, *PARTIAL]
    straight = train(tiny_config(*overrides), run_dir=tmp_path / "straight")
    rows = _metrics(tmp_path / "straight")
    assert rows[1]["rollout/in_flight"] > 0  # step 2's checkpoint holds sequences in flight
    update = LearnerClass.update

    def crash_at_the_third(self, batch):
        if self.version == 2:
            raise KeyboardInterrupt
        return update(self, batch)

    monkeypatch.setattr(LearnerClass, "update", crash_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_config(*overrides), run_dir=tmp_path / "split")
    monkeypatch.setattr(LearnerClass, "update", update)
    resumed = train(tiny_config(*overrides), run_dir=tmp_path / "split", resume=True)
    for name, value in straight.model.state_dict().items():
        torch.testing.assert_close(value, resumed.model.state_dict()[name], atol=1e-6, rtol=0, msg=name)
    after = _metrics(tmp_path / "split")[-2:]
    for key in ("loss/policy", "async/partial_sequences", "reward/mean", "rollout/in_flight"):
        assert [row[key] for row in after] == pytest.approx([row[key] for row in rows[2:]], rel=1e-6), key
