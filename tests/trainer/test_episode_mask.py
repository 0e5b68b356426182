"""Multi-turn episodes in the rollout batch (docs/environments.md): a completion may hold environment tokens
(an observation, a tool's output) between the model's turns. They are inputs, never targets: the loss's
mask is 0 there, the token count the loss averages over leaves them out, the engine's log-probs there
(which do not exist) weigh nothing in the ratio, and the mismatch figures skip them."""

from __future__ import annotations

import math

import pytest
import torch

from everyprompt.trainer.learner_side.mismatch import batch_mismatch, mismatch_metrics
from tests.trainer.test_sides import _learner, hand_batch

REWARDS = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]


def _environment_tokens(batch) -> list[torch.Tensor]:
    """Mark the middle third of every completion as environment tokens (False)."""
    masks = []
    for completion in batch.completion_ids:
        mask = torch.ones(len(completion), dtype=torch.bool)
        third = len(completion) // 3
        mask[third : 2 * third] = False
        masks.append(mask)
    return masks


def test_the_padded_mask_and_the_token_count_leave_environment_tokens_out():
    learner, model, tokenizer = _learner()
    batch = hand_batch(model, tokenizer, REWARDS)
    plain = batch.padded(range(len(batch)), 0)["mask"]
    batch.completion_mask = _environment_tokens(batch)
    masked = batch.padded(range(len(batch)), 0)["mask"]
    for row, completion_mask in enumerate(batch.completion_mask):
        start = len(batch.prompt_ids[row]) - 1
        span = masked[row, start : start + len(completion_mask)]
        assert torch.equal(span, completion_mask.float())
    assert torch.equal(masked, plain * masked)  # nothing outside the completions is added
    rows = list(range(len(batch)))
    assert batch.trained_tokens(rows) == int(masked.sum()) < int(plain.sum())


def _update(batch, learner) -> dict[str, torch.Tensor]:
    learner.update(batch)
    return {name: value.clone() for name, value in learner.state_dict().items()}


def test_environment_tokens_weigh_nothing_in_the_update():
    """Two updates from the same state, whose batches differ only in the engine's log-probs at environment
    positions (old = rollout log-probs, so a weight there would move the ratio): the same weights after."""
    overrides = ("rl.old_logprobs=rollout", "rl.mini_batches=1", "rl.lr=1e-2")
    weights = []
    for garbage in (0.0, -7.5):
        learner, model, tokenizer = _learner(*overrides)
        batch = hand_batch(model, tokenizer, REWARDS)
        batch.completion_mask = _environment_tokens(batch)
        for logprobs, mask in zip(batch.rollout_logprobs, batch.completion_mask):
            logprobs[~mask] = garbage
        weights.append(_update(batch, learner))
    for name, value in weights[0].items():
        assert torch.equal(value, weights[1][name]), name
    # and the environment tokens are not trained: without the mask the same garbage moves the weights
    learner, model, tokenizer = _learner(*overrides)
    batch = hand_batch(model, tokenizer, REWARDS)
    for logprobs, mask in zip(batch.rollout_logprobs, _environment_tokens(batch)):
        logprobs[~mask] = -7.5
    unmasked = _update(batch, learner)
    assert any(not torch.equal(value, unmasked[name]) for name, value in weights[0].items())


def test_mismatch_figures_skip_environment_tokens():
    learner, model, tokenizer = _learner()
    batch = hand_batch(model, tokenizer, REWARDS)
    batch.completion_mask = _environment_tokens(batch)
    trainer = [logprobs.clone() for logprobs in batch.rollout_logprobs]  # the engine's own values
    for logprobs, mask in zip(batch.rollout_logprobs, batch.completion_mask):
        logprobs[~mask] = 0.0  # no engine log-prob exists for an environment token
    rows = list(range(len(batch)))
    assert batch_mismatch(batch, rows, trainer, None)["mismatch/logp_abs_diff"] == 0.0
    batch.completion_mask = None
    assert batch_mismatch(batch, rows, trainer, None)["mismatch/logp_abs_diff"] > 0.1


def test_masked_mismatch_by_hand_with_routes():
    """A prompt of 2 tokens and a completion of 3 whose middle token is the environment's: the figures
    count the two model tokens only, the flipped-routing ones too."""
    engine_routes = [torch.tensor([[[0, 1]], [[2, 3]], [[0, 2]], [[1, 3]]], dtype=torch.int16)]
    trainer_routes = [torch.tensor([[[0, 1]], [[2, 1]], [[0, 2]], [[1, 3]]], dtype=torch.int16)]
    metrics = mismatch_metrics(
        [2],
        [torch.tensor([-1.0 + math.log(3), -5.0, -2.0])],  # first model token: ratio 3
        [torch.tensor([-1.0, 0.0, -2.0])],  # no engine log-prob at the environment token
        trainer_routes,
        engine_routes,
        masks=[torch.tensor([True, False, True])],
    )
    # the targets are predicted from fed tokens 1, 2, 3: token 1 flipped -> the first (model) target
    assert metrics["mismatch/logp_abs_diff"] == pytest.approx(math.log(3) / 2)
    assert metrics["mismatch/flipped_token_fraction"] == 0.5
    assert metrics["mismatch/logp_abs_diff_flipped"] == pytest.approx(math.log(3))
    assert metrics["mismatch/logp_abs_diff_unflipped"] == 0.0
    assert metrics["mismatch/routing_agreement"] == pytest.approx(3 / 4)  # over every fed token


def test_the_rollout_side_carries_each_completions_mask_into_the_batch():
    """An episode's Completion.completion_mask becomes the batch's; a plain completion beside it is all
    model tokens; a batch without episodes has no mask at all."""
    from everyprompt.rollout import Completion
    from everyprompt.trainer.rollout_side.assemble import assemble_batch
    from everyprompt.zve.expansion import Group

    def completion(n, mask=None):
        return Completion(0, [1, 2], list(range(3, 3 + n)), torch.zeros(n), "eos", completion_mask=mask)

    episode = completion(4, torch.tensor([True, False, False, True]))
    groups = [Group(0, 0, [(episode, "a"), (completion(3), "b")], [1.0, 0.0])]
    batch = assemble_batch(groups, max_new_tokens=8, version=0)
    assert [m.tolist() for m in batch.completion_mask] == [[True, False, False, True], [True, True, True]]
    assert batch.trained_tokens([0, 1]) == 5
    plain = assemble_batch([Group(0, 0, [(completion(3), "b")], [1.0])], max_new_tokens=8, version=0)
    assert plain.completion_mask is None and plain.reward_components == {}
    parted = Group(
        0, 0, [(completion(3), "b"), (completion(2), "c")], [1.0, 0.5], components=[{"a": 1.0}, None]
    )
    mixed = assemble_batch([parted, Group(1, 1, [(completion(3), "d")], [0.0])], max_new_tokens=8, version=0)
    assert mixed.reward_components["a"][0] == 1.0 and mixed.reward_components["a"][1:].isnan().all()
