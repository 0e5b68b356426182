"""Asynchronous training (rl.max_staleness): the synchronous loop unchanged at k = 0, the staleness bound
held per token, nothing thrown away, errors of the rollout thread surfacing, and exact resume."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from everyprompt.config import ConfigError
from everyprompt.pipeline import Run, train
from everyprompt.trainer.learner_side.learner import Learner
from everyprompt.trainer.rollout_side import LocalRolloutSide
from tests.conftest import tiny_config

ASYNC = ["rl.old_logprobs=recompute", "rl.rollout_correction.mode=tis"]
SIGNAL = [
    "rewards.function=tests.trainer.flaky_reward:hashed",
    "rl.lr=1e-2",
    "rl.group_size=6",
]  # every step updates


def _parameters(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


def _no_rollout_thread() -> bool:
    return not any(t.name == "everyprompt-rollout" for t in threading.enumerate())


def test_max_staleness_0_is_the_two_sides_composed_by_hand(tmp_path):
    config = tiny_config("rl.steps=3", "rollout.parity_threshold=0", *SIGNAL)
    trainer = train(config, run_dir=tmp_path / "loop")
    reference = Run(config, tmp_path / "by_hand").trainer()
    try:
        for step in range(3):
            batch = reference.rollout.next_batch(step)
            reference.learner.update(batch)
            reference.rollout.load_weights(reference.learner.state_dict(), step + 1)
    finally:
        reference.close()
    ours, theirs = _parameters(trainer.model), _parameters(reference.model)
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    assert not any(key.startswith("async/") for row in _metrics(tmp_path / "loop") for key in row)


@pytest.mark.long  # 7 s on 2 cores: `make test-long`
@pytest.mark.parametrize("k", [1, 2])
def test_tokens_are_never_staler_than_the_bound_and_no_batch_is_thrown_away(tmp_path, monkeypatch, k):
    seen: list[tuple[int, set[int]]] = []  # (learner version, token versions) per update
    made: list[int] = []
    update, next_batch = Learner.update, LocalRolloutSide.next_batch

    def record_update(self, batch):
        seen.append((self.version, {int(v) for row in batch.versions for v in row}))
        return update(self, batch)

    def record_batch(self, step):
        made.append(step)
        return next_batch(self, step)

    monkeypatch.setattr(Learner, "update", record_update)
    monkeypatch.setattr(LocalRolloutSide, "next_batch", record_batch)
    trainer = train(tiny_config("rl.steps=5", f"rl.max_staleness={k}", *ASYNC, *SIGNAL), run_dir=tmp_path)
    # batch b is sampled by version max(0, b - k) exactly, every token of it
    assert seen == [(b, {max(0, b - k)}) for b in range(5)]
    assert made == list(range(5))  # each batch made once, and every one trained on
    rows = _metrics(tmp_path)
    assert [row["async/staleness_max"] for row in rows] == [float(min(b, k)) for b in range(5)]
    assert all(row["async/staleness_mean"] <= k for row in rows)
    assert all(row["async/learner_wait_s"] >= 0 and row["async/rollout_wait_s"] >= 0 for row in rows)
    assert trainer.rollout.version == 5  # the final evaluation decoded with the final weights
    assert _no_rollout_thread()


@pytest.mark.long  # 7 s on 2 cores: `make test-long`
def test_a_resumed_asynchronous_run_equals_an_uninterrupted_one(tmp_path, monkeypatch):
    overrides = ["rl.steps=4", "rl.max_staleness=1", *ASYNC, *SIGNAL]
    straight = train(tiny_config(*overrides), run_dir=tmp_path / "straight")
    update = Learner.update

    def crash_at_the_third(self, batch):
        if self.version == 2:
            raise KeyboardInterrupt  # a kill during step 3's update: step 2's checkpoint is the last
        return update(self, batch)

    monkeypatch.setattr(Learner, "update", crash_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_config(*overrides), run_dir=tmp_path / "split")
    assert _no_rollout_thread()
    monkeypatch.setattr(Learner, "update", update)
    resumed = train(tiny_config(*overrides), run_dir=tmp_path / "split", resume=True)
    assert resumed.step == 4
    ours, theirs = _parameters(straight.model), _parameters(resumed.model)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-6, rtol=0, msg=name)
    losses = [row["loss/policy"] for row in _metrics(tmp_path / "straight")]
    assert all(row["actor/grad_norm"] > 0 for row in _metrics(tmp_path / "straight"))  # every step updated
    after = [row["loss/policy"] for row in _metrics(tmp_path / "split")][-2:]
    assert after == pytest.approx(losses[2:], rel=1e-6, abs=1e-9)


def test_an_error_in_the_rollout_thread_stops_the_run_with_it(tmp_path, capsys):
    from everyprompt.cli import main
    from tests.conftest import TINY_OVERRIDES

    argv = [
        "train",
        *TINY_OVERRIDES,
        "rl.max_staleness=1",
        *ASYNC,
        "rewards.function=tests.trainer.flaky_reward:wrong_signature",
    ]
    assert main([*argv, "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "every reward of step 0 failed" in err and "TypeError" in err
    assert _no_rollout_thread()


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["rl.max_staleness=1", "rl.old_logprobs=rollout"], "old_logprobs"),
        (["rl.max_staleness=1", "rl.old_logprobs=recompute"], "rl.rollout_correction.mode=tis"),
    ],
)
def test_asynchrony_without_the_decoupled_objective_is_a_config_error(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        tiny_config(*overrides)


def test_the_mismatch_is_measured_against_the_weights_that_sampled(tmp_path, monkeypatch):
    """An asynchronous batch is one version older than the learner: mismatch/* come from a replica at
    the sampling version (fp32 engine and trainer: they agree), the learner's own comparison with the
    engine, which adds an update's change of policy, is async/proximal_*."""
    measured = []
    behaviour_mismatch = Learner.behaviour_mismatch

    def spy(self, batch, weights, rows):
        measured.append((len(rows), int(batch.versions[0][0])))
        return behaviour_mismatch(self, batch, weights, rows)

    monkeypatch.setattr(Learner, "behaviour_mismatch", spy)
    overrides = ["rl.steps=3", "rl.max_staleness=1", "rl.async_mismatch_rows=5", "rl.router_replay=r3"]
    train(tiny_config(*overrides, *ASYNC, *SIGNAL), run_dir=tmp_path)
    assert measured == [(5, 0), (5, 0), (5, 1)]  # batches 0 and 1 by version 0, batch 2 by version 1
    rows = _metrics(tmp_path)
    for row in rows:
        assert row["mismatch/logp_abs_diff"] < 1e-4 and row["mismatch/routing_agreement"] == 1.0
    # steps 2 and 3 trained on a batch one update old: their proximal policy had moved away from it
    assert all(row["async/proximal_logp_abs_diff"] > 10 * row["mismatch/logp_abs_diff"] for row in rows[1:])


@pytest.mark.long  # 7 s on 2 cores: `make test-long`
def test_the_two_sides_share_the_cores_unless_threads_is_set(tmp_path, monkeypatch):
    """threads: 0 (torch's default): each side computes with half the threads during the asynchronous
    phase, and the process gets all of them back after it; an explicit `threads` is left as set."""
    seen: dict[str, set[int]] = {"rollout": set(), "learner": set()}
    next_batch, update = LocalRolloutSide.next_batch, Learner.update

    def sampling(self, step):
        seen["rollout"].add(torch.get_num_threads())
        return next_batch(self, step)

    def updating(self, batch):
        seen["learner"].add(torch.get_num_threads())
        return update(self, batch)

    monkeypatch.setattr(LocalRolloutSide, "next_batch", sampling)
    monkeypatch.setattr(Learner, "update", updating)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        train(tiny_config("rl.steps=2", "rl.max_staleness=1", *ASYNC), run_dir=tmp_path / "auto")
        assert seen == {"rollout": {1}, "learner": {1}} and torch.get_num_threads() == 2
        seen = {"rollout": set(), "learner": set()}
        train(tiny_config("rl.steps=2", "rl.max_staleness=1", "threads=2", *ASYNC), run_dir=tmp_path / "set")
        assert seen == {"rollout": {2}, "learner": {2}}
    finally:
        torch.set_num_threads(before)
