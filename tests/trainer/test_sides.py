"""Each side of the RL loop alone: the learner from a hand-made RolloutBatch, the rollout side with a stub
reward; and the three fixes that came with the split (r2 routes, mismatch at no cost, dropping)."""

from __future__ import annotations

import math

import pytest
import torch

import everyprompt.trainer.learner_side.step as step_module
from everyprompt.batch import RolloutBatch
from everyprompt.data.passrate import PassRateStore
from everyprompt.models import load_model_and_tokenizer
from everyprompt.rewards.pool import RewardPool
from everyprompt.rollout import build_engine, derive_seed
from everyprompt.trainer import Learner, LocalRolloutSide
from everyprompt.trainer.learner_side.logprobs import token_logprobs
from everyprompt.trainer.learner_side.optim import NumericsError
from tests.conftest import tiny_config

# (prompt, completion) per row; rows 2k and 2k+1 form group k
ROWS = [
    ("1+2=", "3|3"),
    ("1+2=", "4|4"),
    ("3+4=", "7|7"),
    ("3+4=", "7|7"),
    ("5+1=", "6|6"),
    ("5+1=", "6|6|6"),
]


def _model(config):
    model, tokenizer = load_model_and_tokenizer(config.model, config.seed)
    with torch.no_grad():  # larger weights than the init, so that routers pick distinct experts per token
        generator = torch.Generator().manual_seed(1)
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model, tokenizer


def _learner(*overrides: str):
    """A Learner over a fresh tiny model: (learner, model, tokenizer)."""
    config = tiny_config(*overrides)
    model, tokenizer = _model(config)
    return Learner(config, model, tokenizer.pad_token_id), model, tokenizer


def hand_batch(model, tokenizer, rewards: list[float], rows=ROWS, routes=None) -> RolloutBatch:
    """A batch as the rollout side would build it, with the model's own log-probs as the engine's."""
    prompts = [tokenizer(p).input_ids for p, _ in rows]
    completions = [
        tokenizer(c, add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for _, c in rows
    ]
    engine_logprobs = []
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions):
            logp, _ = token_logprobs(model, torch.tensor([prompt + completion]))
            engine_logprobs.append(logp[0, len(prompt) - 1 :].clone())
    return RolloutBatch(
        prompt_ids=prompts,
        completion_ids=completions,
        rollout_logprobs=engine_logprobs,
        finish_reason=["eos"] * len(rows),
        group_index=torch.arange(len(rows)) // 2,
        prompt_index=[i // 2 for i in range(len(rows))],
        rewards=torch.tensor(rewards),
        routed_experts=routes,
        max_new_tokens=12,
    )


def test_the_learner_updates_from_a_hand_made_batch():
    learner, model, tokenizer = _learner("rl.old_logprobs=recompute", "rl.mini_batches=1", "rl.lr=1e-2")
    batch = hand_batch(model, tokenizer, [1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    before = {k: v.clone() for k, v in learner.state_dict().items()}
    metrics = learner.update(batch)
    # GRPO: group [1, 0] has mean 0.5 and unbiased std sqrt(2 * 0.25 / 1) = 0.7071 -> A = +-0.7071
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(batch.advantages, torch.tensor([a, -a, 0.0, 0.0, -a, a]))
    assert metrics["actor/skipped_updates"] == 0 and math.isfinite(metrics["loss/policy"])
    assert metrics["mismatch/logp_abs_diff"] < 1e-5  # the batch's engine log-probs are the model's own
    assert learner.version == 1
    after = learner.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert after.keys() == model.state_dict().keys()


def test_a_checkpoint_before_the_first_step_leaves_the_optimizer_as_it_was():
    """torch's portable optimizer getter creates Adam's state by a zero-gradient step, which would count as
    the first and shrink the real first update (and, on rank 0 alone, set ddp replicas apart)."""
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    settings = ("rl.old_logprobs=recompute", "rl.lr=1e-2")
    plain, model, tokenizer = _learner(*settings)
    saved, _, _ = _learner(*settings)
    state = saved.training_state()
    assert state["optimizer"] == {} and not saved.optimization.optimizer.state
    resumed, _, _ = _learner(*settings)
    resumed.load_training_state(state)
    for learner in (plain, saved, resumed):
        learner.update(hand_batch(model, tokenizer, rewards))
    for key, value in plain.state_dict().items():
        assert torch.equal(saved.state_dict()[key], value), key
        assert torch.equal(resumed.state_dict()[key], value), key
    steps = {int(s["step"]) for s in saved.optimization.optimizer.state.values()}
    assert steps == {2}  # two mini-batch steps, none of them a zero step
    assert saved.training_state()["optimizer"]["state"]  # once stepped, the state is saved


def _forced_routes(batch: RolloutBatch, layers: int) -> list[torch.Tensor]:
    """Engine routes unlike any router's: every token to experts (0, 1) in every layer."""
    routes = []
    for prompt, completion in zip(batch.prompt_ids, batch.completion_ids):
        routes.append(
            torch.tensor([0, 1], dtype=torch.int16).expand(len(prompt) + len(completion) - 1, layers, 2)
        )
    return routes


@pytest.mark.parametrize("mode", ["r2", "r3"])
def test_r2_replays_the_trainers_own_routes_and_r3_the_engines(monkeypatch, mode):
    learner, model, tokenizer = _learner(
        f"rl.router_replay={mode}",
        "rl.old_logprobs=recompute",
        "model.pack_sequences=false",
        "rl.micro_batch_size=8",
    )
    batch = hand_batch(model, tokenizer, [1.0, 0.0] * 3)
    batch.routed_experts = _forced_routes(batch, model.config.num_hidden_layers)
    replayed = []
    real_replay = learner.router.replay

    def spy(indices):
        replayed.append(indices.clone())
        return real_replay(indices)

    monkeypatch.setattr(learner.router, "replay", spy)
    metrics = learner.update(batch)
    # r3: the old-policy pass (the second mini-batch's rows) and both mini-batches replay the engine's
    # routes; r2: the first mini-batch's forward is the old policy and routes by itself, the second one
    # replays the routes the old-policy pass recorded for its rows
    assert len(replayed) == (3 if mode == "r3" else 1)
    given = [r[r[:, 0, 0] >= 0] for r in replayed]  # positions with a route (the rest is padding)
    forced = torch.tensor([0, 1])
    if mode == "r3":
        assert all(bool((g == forced).all()) for g in given)
        assert metrics["mismatch/routing_agreement"] == 1.0  # the trainer computed the engine's network
    else:
        assert not any(bool((g == forced).all()) for g in given)  # its own routes, not the engine's
        own = torch.cat([r for r in batch.old_routes if r is not None]).long()
        assert sum(r is None for r in batch.old_routes) == 3  # the first mini-batch's rows
        assert sorted(torch.cat(given).flatten().tolist()) == sorted(own.flatten().tolist())
        assert metrics["mismatch/routing_agreement"] < 0.9


def test_mismatch_is_measured_without_a_separate_old_policy_pass():
    """rl.old_logprobs=rollout (the demo's): the first mini-batch's forward is the old policy."""
    learner, model, tokenizer = _learner("rl.old_logprobs=rollout", "rl.mini_batches=2")
    batch = hand_batch(model, tokenizer, [1.0, 0.0] * 3)
    batch.rollout_logprobs = [x + 0.5 for x in batch.rollout_logprobs]  # an engine 0.5 nats off everywhere
    batch.routed_experts = _forced_routes(batch, model.config.num_hidden_layers)
    metrics = learner.update(batch)
    assert metrics["mismatch/logp_abs_diff"] == pytest.approx(0.5, abs=1e-5)
    assert 0 < metrics["mismatch/routing_agreement"] < 1  # replay is off: the trainer routed on its own


@pytest.mark.parametrize("drop", [True, False])
def test_drop_zero_variance_drops_what_stays_zero_variance_after_every_stage(monkeypatch, drop):
    learner, model, tokenizer = _learner(
        "zve.enabled=true",
        "zve.zvp.enabled=false",
        f"zve.drop_zero_variance={str(drop).lower()}",
        "rl.mini_batches=1",
        "rl.micro_batch_size=64",
        "rl.old_logprobs=recompute",
    )
    # group 0 informative; group 1 all-correct with identical completions: reshaping cannot break the tie;
    # group 2 all-correct with lengths 4 and 6: reshaping makes it informative
    batch = hand_batch(model, tokenizer, [1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    rows_seen = []
    real_policy_loss = step_module.policy_loss

    def spy(name, batch, *args, **kwargs):
        rows_seen.append(batch.logp.shape[0])
        return real_policy_loss(name, batch, *args, **kwargs)

    monkeypatch.setattr(step_module, "policy_loss", spy)
    metrics = learner.update(batch)
    assert metrics["zve/reshaped_groups"] == 1 and metrics["zve/zero_variance_rate_final"] == pytest.approx(
        1 / 3
    )
    assert sum(rows_seen) == (4 if drop else 6)
    assert metrics.get("zve/dropped_zero_variance_groups", 0) == (1 if drop else 0)


def test_the_rollout_side_with_a_stub_reward():
    config = tiny_config("rl.prompts_per_step=3", "rl.group_size=4", "rollout.max_new_tokens=6")
    model, tokenizer = _model(config)
    prompts = [{"prompt": f"{a}+{a}=", "answer": str(2 * a), "level": 1} for a in range(1, 8)]
    calls = []

    def stub(completions, answer, level, **_):
        calls.append(len(completions))
        return [float(len(text) % 2) for text in completions]

    def side() -> LocalRolloutSide:
        pool = RewardPool(stub, workers=0)
        return LocalRolloutSide(
            config, build_engine(config.rollout, model, tokenizer), tokenizer, prompts, pool, PassRateStore()
        )

    first = side()
    batch = first.next_batch(0)
    assert len(batch) == 12 and batch.group_index.tolist() == [g for g in range(3) for _ in range(4)]
    assert batch.rewards.tolist() == [float(len(t) % 2) for t in batch.completion_text]
    assert calls == [12]  # the inline pool scores one generate call in one reward call
    assert all(len(c) <= 6 for c in batch.completion_ids) and batch.max_new_tokens == 6
    layers, top_k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    for prompt, completion, routes in zip(batch.prompt_ids, batch.completion_ids, batch.routed_experts):
        assert routes.shape == (len(prompt) + len(completion) - 1, layers, top_k)
    for key in ("reward/mean", "reward/accuracy", "zve/generated_rollouts", "rollout/tokens_per_s"):
        assert key in batch.stats
    assert len(first.store) == 3 and set(batch.timing) == {"rollout_s", "generate_s", "reward_wait_s"}
    # the same step from a fresh side samples the same completions; the next step other prompts
    again = side().next_batch(0)
    assert again.completion_ids == batch.completion_ids
    assert first.next_batch(1).prompt_index != batch.prompt_index
    first.close()


def _poison_gradients(model) -> None:
    """The loss stays finite, the gradient does not: an inf on one weight's gradient."""
    weight = model.lm_head.weight
    weight.register_hook(lambda grad: torch.full_like(grad, float("inf")))


def test_a_non_finite_gradient_norm_skips_the_update():
    learner, model, tokenizer = _learner(
        "rl.mini_batches=1", "rl.old_logprobs=recompute", "rl.max_skipped_updates=2"
    )
    batch = hand_batch(model, tokenizer, [1.0, 0.0] * 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _poison_gradients(model)
    metrics = learner.update(batch)
    assert metrics["actor/skipped_updates"] == 1.0 and "loss/policy" not in metrics
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # no step was taken
    assert all(not state for state in learner.optimization.optimizer.state.values())  # nor any moment updated
    with pytest.raises(NumericsError, match=r"2 updates in a row were skipped.*gradient norm = inf"):
        learner.update(hand_batch(model, tokenizer, [1.0, 0.0] * 3))


def test_a_good_update_resets_the_skip_count():
    learner, model, tokenizer = _learner(
        "rl.mini_batches=1", "rl.old_logprobs=recompute", "rl.max_skipped_updates=2"
    )
    learner.optimization.consecutive_skips = 1
    metrics = learner.update(hand_batch(model, tokenizer, [1.0, 0.0] * 3))
    assert metrics["actor/skipped_updates"] == 0 and learner.optimization.consecutive_skips == 0


@pytest.mark.parametrize("replay", ["off", "r2", "r3"])
def test_the_first_mini_batch_as_its_own_old_policy_equals_a_full_old_policy_pass(replay):
    """The fast path (old values of the first mini-batch from its own forward) against the simple one: a
    no-grad pass over every row, then every mini-batch reads its old values from it."""
    from everyprompt.trainer.learner_side.signal import batch_advantages

    options = (
        f"rl.router_replay={replay}",
        "rl.old_logprobs=recompute",
        "rl.micro_batch_size=2",
        "rl.lr=1e-2",
    )
    fast, model, tokenizer = _learner(*options)
    batch = hand_batch(model, tokenizer, [1.0, 0.0] * 3)
    if replay == "r3":
        batch.routed_experts = _forced_routes(batch, model.config.num_hidden_layers)
    simple, reference_model, _ = _learner(*options)
    simple_batch = hand_batch(reference_model, tokenizer, [1.0, 0.0] * 3)
    simple_batch.routed_experts = batch.routed_experts
    metrics = fast.update(batch)
    # the simple path, by hand: the same mini-batch order, the old policy over all rows first
    batch_advantages(simple_batch, simple.rl, simple.zve)
    seed = derive_seed(simple.config.seed, 0, 7)
    order = torch.randperm(len(simple_batch), generator=torch.Generator().manual_seed(seed))
    simple.old_logprobs(simple_batch)
    steps = [simple.step(simple_batch, m.tolist(), False, 0) for m in order.chunk(2)]
    for key in ("loss/policy", "actor/grad_norm", "actor/ratio_mean", "actor/clip_fraction"):
        assert metrics[key] == pytest.approx(sum(step[key] for step in steps) / 2, rel=1e-5, abs=1e-7), key
    # the weights agree up to rounding that AdamW's first steps amplify (sign(g) where g ~ 0): a wrong old
    # policy would move them by ~lr = 1e-2
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, reference_model.state_dict()[name], atol=1e-3, rtol=0)
    assert any(  # the update moved the policy, so the comparison compares something
        not torch.allclose(value, _model(tiny_config(*options))[0].state_dict()[name])
        for name, value in model.state_dict().items()
    )
