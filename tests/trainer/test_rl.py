import json

import pytest
import torch

from everyprompt.batch import RolloutBatch
from everyprompt.pipeline import Run, train
from everyprompt.pipeline.resume import resolve_checkpoint
from everyprompt.trainer.checkpoint import load_trainer_state
from everyprompt.zve import zero_variance_rate
from tests.conftest import tiny_config


def _parameters(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_padded_layout_aligns_targets():
    batch = RolloutBatch(
        prompt_ids=[[1, 5, 6], [1, 7]],
        completion_ids=[[8, 2], [9, 9, 2]],
        rollout_logprobs=[torch.tensor([-0.1, -0.2]), torch.tensor([-0.3, -0.4, -0.5])],
        finish_reason=["eos", "eos"],
        group_index=torch.tensor([0, 0]),
        prompt_index=[0, 0],
    )
    data = batch.padded([0, 1], pad_id=0)
    assert data["input_ids"].tolist() == [[1, 5, 6, 8, 2], [1, 7, 9, 9, 2]]
    # targets are input_ids[:, 1:]; completion targets start at index len(prompt) - 1
    assert data["mask"].tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    assert data["rollout_logp"][1].tolist() == pytest.approx([0.0, -0.3, -0.4, -0.5])
    back = batch.completion_values([0, 1], data["rollout_logp"])
    assert [b.tolist() for b in back] == [pytest.approx([-0.1, -0.2]), pytest.approx([-0.3, -0.4, -0.5])]


def test_zero_variance_rate_hand_computed():
    # groups: (1, 1) ZV, (0, 1) informative, (0, NaN) one valid reward -> ZV
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, float("nan")])
    assert zero_variance_rate(rewards, torch.tensor([0, 0, 1, 1, 2, 2])) == pytest.approx(2 / 3)


def test_train_writes_metrics_checkpoints_and_tensorboard(tmp_path):
    config = tiny_config()
    trainer = train(config, run_dir=tmp_path)
    assert trainer.step == 2
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for key in (
        "reward/mean",
        "zve/zero_variance_rate",
        "rollout/tokens_per_s",
        "rollout/slot_occupancy",
        "rollout/decode_step_ms",
        "time/rollout_s",
        "time/generate_s",
        "time/reward_wait_s",
        "time/train_s",
        "loss/policy",
        "actor/clip_fraction",
        "actor/entropy",
        "actor/grad_norm",
        "mismatch/logp_abs_diff",  # the demo config's rl.old_logprobs=rollout: measured at no extra cost
        "mismatch/routing_agreement",
    ):
        assert key in lines[0], key
    assert lines[0]["mismatch/logp_abs_diff"] < 1e-4 and lines[0]["mismatch/routing_agreement"] == 1.0  # fp32
    assert (tmp_path / "config.yaml").is_file()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    latest = resolve_checkpoint(tmp_path)
    assert latest.name == "step_2"
    assert load_trainer_state(latest)["step"] == 2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded = AutoModelForCausalLM.from_pretrained(latest)
    assert AutoTokenizer.from_pretrained(latest)("1+1=").input_ids[0] == trainer.tokenizer.bos_token_id
    torch.testing.assert_close(reloaded.state_dict(), trainer.model.state_dict())


def test_the_engine_sleeps_while_the_learner_updates_and_the_run_is_unchanged(tmp_path, monkeypatch):
    from everyprompt.trainer.learner_side.learner import Learner

    seen = []
    update = Learner.update

    def watched(self, batch):  # the engine's state while the learner trains
        seen.append(engine.layers is None)
        return update(self, batch)

    monkeypatch.setattr(Learner, "update", watched)
    runs = {}
    for sleep in ("true", "false"):
        trainer = Run(tiny_config(f"rollout.sleep_while_training={sleep}"), tmp_path / sleep).trainer()
        engine = trainer.engine
        trainer.train()
        runs[sleep] = _parameters(trainer.model)
        trainer.close()
    assert seen == [True, True, False, False]
    for name in runs["true"]:
        torch.testing.assert_close(runs["true"][name], runs["false"][name], atol=0, rtol=0, msg=name)


def test_train_and_demo_train_alike(tmp_path):
    """`demo` evaluates before RL and `train` does not; the RL steps are the same all the same (the demo
    config's asynchronous loop, a reward under which every step updates): every figure but the timings."""
    from everyprompt.config import load_config
    from everyprompt.pipeline.commands import demo
    from tests.conftest import TINY_OVERRIDES, computed_figures

    def config():
        return load_config(None, [*TINY_OVERRIDES, "rewards.function=tests.trainer.flaky_reward:scattered"])

    train(config(), run_dir=tmp_path / "train")
    demo(config(), run_dir=tmp_path / "demo")

    trained, demoed = computed_figures(tmp_path / "train"), computed_figures(tmp_path / "demo")
    assert len(trained) == 2 and any(row.get("actor/no_signal_update") == 0.0 for row in trained)
    assert json.dumps(trained, sort_keys=True) == json.dumps(demoed, sort_keys=True)
    final = json.loads((tmp_path / "train" / "eval.json").read_text())["greedy_accuracy"]
    assert final == json.loads((tmp_path / "demo" / "summary.json").read_text())["accuracy_after_rl"]


def test_reward_errors_are_counted_not_fatal(tmp_path):
    trainer = train(
        tiny_config("rl.steps=1", "rewards.function=tests.trainer.flaky_reward:flaky"), run_dir=tmp_path
    )
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert trainer.reward_errors == line["reward/errors"] > 0
    assert line["reward/none_fraction"] > 0


def test_a_hanging_reward_is_cut_at_the_timeout_in_a_run(tmp_path):
    """A reward that never returns on odd-length completions: each such call ends at rewards.timeout_s
    with reward None and a counted error, and the step completes."""
    options = (
        "rl.steps=1",
        "rewards.function=tests.rewards.slow_rewards:hang_on_odd",
        "rewards.timeout_s=0.3",
    )
    trainer = train(tiny_config(*options), run_dir=tmp_path)
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    odd = trainer.rollout.rewards.stats.timeouts
    assert odd > 0 and line["reward/errors"] == odd == trainer.reward_errors
    assert line["time/reward_wait_s"] < 0.3 * odd + 5


def test_update_moves_log_probs_along_the_advantages(tmp_path):
    """One update must raise sum_i A_i * logp(y_i): correct completions up, wrong ones down."""
    from everyprompt.trainer.learner_side.logprobs import token_logprobs

    trainer = Run(tiny_config("rl.lr=1e-3", "rl.mini_batches=1"), tmp_path).trainer()
    batch = trainer.rollout.next_batch(0)
    batch.rewards = torch.tensor([1.0, 0.0] * (len(batch) // 2))  # each group of 2: one right, one wrong
    sign = torch.tensor([1.0, -1.0] * (len(batch) // 2))

    def objective() -> float:
        data = batch.padded(list(range(len(batch))), trainer.tokenizer.pad_token_id)
        with torch.no_grad():
            logp, _ = token_logprobs(trainer.model, data["input_ids"])
        return float(((logp * data["mask"]).sum(-1) * sign).sum())

    before = objective()
    trainer.learner.update(batch)
    assert torch.equal(batch.advantages.sign(), sign)  # the update's own advantages: +1 right, -1 wrong
    assert objective() > before + 1e-3


@pytest.mark.long  # 24 s on 2 cores: `make test-long`
@pytest.mark.parametrize(
    "overrides",
    [
        ("rl.loss=espo",),
        ("rl.loss=espo", "rl.mini_batches=1", "rl.espo.num_groups=3"),
        ("rl.loss=gspo", "rl.advantage=dr_grpo"),
        ("rl.loss=gspo_token", "rl.loss_agg=token-mean"),
        ("rl.loss=cispo", "rl.advantage=rloo"),
        ("rl.kl.estimator=k3", "rl.kl.coef=0.1"),
        (
            "rl.rollout_correction.mode=tis",
            "rl.rollout_correction.level=sequence",
            "rl.old_logprobs=recompute",
        ),
        ("rl.rollout_correction.mode=mis", "rl.old_logprobs=recompute"),
        ("rl.old_logprobs=rollout",),
        ("rl.old_logprobs=rollout", "rl.loss=espo"),
        ("rl.router_replay=r3", "rl.old_logprobs=recompute"),
        ("rl.router_replay=r3", "model.pack_sequences=false"),
        ("rl.router_replay=r2", "rl.old_logprobs=recompute"),
        ("rollout.precision=fp8", "rl.old_logprobs=recompute", "rl.router_replay=r3"),
        ("rollout.precision=bf16", "rl.old_logprobs=recompute", "rl.rollout_correction.mode=tis"),
    ],
)
def test_every_method_trains_through_the_config(tmp_path, overrides):
    trainer = train(tiny_config("rl.steps=1", "checkpoint.every=0", *overrides), run_dir=tmp_path)
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert trainer.step == 1 and line["actor/skipped_updates"] == 0
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    if "rl.loss=espo" in overrides:
        assert "espo/epsilon_mean" in line
        assert ("espo/clip_fraction_high" in line) != ("espo/clip_fraction_0" in line)
    if "rl.kl.estimator=k3" in overrides:
        assert line["actor/kl_ref"] >= 0
    if "rl.rollout_correction.mode=mis" in overrides:
        # the engine and the trainer agree in fp32, so no token is masked
        assert line["rollout_correction/mis_affected_fraction"] == 0


@pytest.mark.parametrize("old_logprobs", ["recompute", "rollout"])
def test_espo_uses_the_sampling_policys_entropies(tmp_path, monkeypatch, old_logprobs):
    """The entropies the loss receives are the pre-update ones, in every mini-batch, not the live model's."""
    import everyprompt.trainer.learner_side.step as step_module
    from everyprompt.trainer.learner_side.logprobs import token_logprobs

    config = tiny_config("rl.loss=espo", "rl.lr=1e-2", f"rl.old_logprobs={old_logprobs}")
    trainer = Run(config, tmp_path).trainer()
    batch = trainer.rollout.next_batch(0)
    batch.rewards = torch.arange(len(batch), dtype=torch.float32)  # every group informative
    data = batch.padded(list(range(len(batch))), trainer.tokenizer.pad_token_id)
    with torch.no_grad():
        _, before = token_logprobs(trainer.model, data["input_ids"], with_entropy=True)
    seen = []
    real_policy_loss = step_module.policy_loss

    def spy(name, inputs, *args, **kwargs):
        seen.append((inputs.entropy.detach().clone(), inputs.rollout_logp))
        return real_policy_loss(name, inputs, *args, **kwargs)

    monkeypatch.setattr(step_module, "policy_loss", spy)
    trainer.learner.update(batch)
    assert len(seen) == len(batch) // trainer.rl.micro_batch_size  # every micro-batch of both mini-batches
    # rows are matched by their engine log-probs (distinct per completion); padding widths may differ
    expected = {
        tuple(row[data["mask"][i] > 0].tolist()): before[i][data["mask"][i] > 0]
        for i, row in enumerate(data["rollout_logp"])
    }
    for entropy, rollout_logp in seen:
        for row, values in zip(rollout_logp, entropy):
            kept = row != 0
            torch.testing.assert_close(values[kept], expected[tuple(row[kept].tolist())], atol=1e-5, rtol=0)


def test_rollout_logprobs_stand_for_the_recomputed_old_ones(tmp_path):
    """`rl.old_logprobs=rollout` skips a forward pass; in fp32 it must give what the pass would have."""
    trainer = Run(tiny_config("rl.loss=espo", "rl.old_logprobs=rollout"), tmp_path).trainer()
    batch = trainer.rollout.next_batch(0)
    trainer.learner.old_logprobs(batch)
    recomputed = torch.cat(batch.old_logprobs), torch.cat(batch.old_entropies)
    trainer.learner.old_policy.from_rollout(batch)
    assert batch.old_logprobs is batch.rollout_logprobs
    torch.testing.assert_close(torch.cat(batch.old_logprobs), recomputed[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat(batch.old_entropies), recomputed[1], atol=1e-5, rtol=0)


def test_zero_variance_rate_equals_a_loop():
    generator = torch.Generator().manual_seed(4)
    rewards = torch.randint(0, 2, (40,), generator=generator).float()
    rewards[::6] = float("nan")
    rewards[32:36] = float("nan")  # a group with no valid reward
    groups = torch.arange(10).repeat_interleave(4)
    expected = 0
    for g in range(10):
        values = rewards[(groups == g) & ~torch.isnan(rewards)]
        expected += int(values.numel() == 0 or bool((values == values[0]).all()))
    assert zero_variance_rate(rewards, groups) == pytest.approx(expected / 10)


def test_a_reward_that_always_fails_stops_the_run_with_its_traceback(tmp_path, capsys):
    from everyprompt.cli import main
    from tests.conftest import TINY_OVERRIDES

    argv = ["train", *TINY_OVERRIDES, "rewards.function=tests.trainer.flaky_reward:wrong_signature"]
    assert main([*argv, "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "every reward of step 0 failed" in err and "TypeError" in err and "Traceback" in err
    assert not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text()


def test_reward_health_judges_the_window_hand_computed():
    from everyprompt.rewards import RewardError
    from everyprompt.rewards.base import RewardFailure
    from everyprompt.rewards.health import RewardHealth

    health = RewardHealth(max_error_fraction=0.5, window=3)
    bad = RewardFailure("ValueError: bad", "Traceback ...")
    health.check(0, [bad] * 3, 4)  # 3 of 4: the window is not full yet
    health.check(1, [bad] * 1, 4)  # 4 of 8
    with pytest.raises(
        RewardError, match=r"7 of the 12 rewards of the last 3 steps failed.*3 x ValueError: bad"
    ):
        health.check(2, [bad] * 3, 4)  # 7 of 12 > 0.5
    fine = RewardHealth(max_error_fraction=0.5, window=3)
    for step in range(5):
        fine.check(step, [bad] * 2, 4)  # exactly half: goes on
    with pytest.raises(RewardError, match="every reward of step 5 failed"):
        fine.check(5, [bad] * 4, 4)


def test_batch_select_keeps_rows_and_renumbers_groups():
    batch = RolloutBatch(
        prompt_ids=[[1], [1], [2], [2], [3], [3]],
        completion_ids=[[4], [5], [6], [7], [8], [9]],
        rollout_logprobs=[torch.tensor([float(-i)]) for i in range(6)],
        finish_reason=["eos", "length"] * 3,
        group_index=torch.tensor([0, 0, 1, 1, 2, 2]),
        prompt_index=[7, 7, 8, 8, 9, 9],
        rewards=torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0]),
        reward_components={"exact": torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])},
        max_new_tokens=5,
    )
    kept = batch.select([0, 1, 4, 5])  # group 1 dropped: group 2 becomes group 1
    assert kept.group_index.tolist() == [0, 0, 1, 1] and kept.prompt_index == [7, 7, 9, 9]
    assert kept.completion_ids == [[4], [5], [8], [9]] and kept.finish_reason == ["eos", "length"] * 2
    assert kept.rewards.tolist() == [1.0, 0.0, 0.0, 1.0] and kept.reward_components["exact"].tolist() == [
        1,
        0,
        0,
        1,
    ]
    assert [float(x) for x in kept.rollout_logprobs] == [0.0, -1.0, -4.0, -5.0]
    assert kept.completion_text == [] and kept.routed_experts is None and kept.max_new_tokens == 5
    assert len(batch) == 6  # the original is left as it was


def test_a_step_without_signal_makes_no_update(tmp_path):
    """Every group all-right: no optimizer step (weights, Adam's state and the schedule untouched), counted."""
    config = tiny_config(
        "rl.steps=2", "checkpoint.every=0", "rewards.function=tests.trainer.flaky_reward:always"
    )
    trainer = Run(config, tmp_path).trainer()
    before = _parameters(trainer.model)
    learner = trainer.learner
    trainer.train()
    trainer.close()
    torch.testing.assert_close(_parameters(trainer.model), before, rtol=0, atol=0)
    assert not learner.optimization.optimizer.state  # Adam never stepped: no moments to replay
    assert learner.optimization.scheduler.last_epoch == 0  # no schedule tick either
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["actor/no_signal_update"] for line in lines] == [1.0, 1.0]
    assert all("loss/policy" not in line and "actor/skipped_updates" not in line for line in lines)


def test_a_step_with_signal_updates_and_ticks_the_schedule(tmp_path):
    config = tiny_config("rl.steps=1", "checkpoint.every=0", "rl.lr=1e-2")  # the scattered reward: signal
    trainer = Run(config, tmp_path).trainer()
    before = _parameters(trainer.model)
    trainer.train()
    trainer.close()
    assert any(not torch.equal(before[k], v) for k, v in _parameters(trainer.model).items())
    assert (
        trainer.learner.optimization.scheduler.last_epoch == 1
        and trainer.learner.optimization.optimizer.state
    )
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert line["actor/no_signal_update"] == 0.0 and "loss/policy" in line


def test_a_hook_sees_every_step_and_ends_the_run_where_it_says(tmp_path):
    """`train(hooks=...)`: told once before the first step, after each step with its metrics, and a True
    from any hook ends the run after that step, its final checkpoint written as at `rl.steps`; the steps
    before are those of a run without hooks."""
    from tests.conftest import computed_figures

    class Stop:
        def __init__(self, at: int):
            self.at, self.begun, self.seen = at, [], []

        def on_train_begin(self, trainer):
            self.begun.append(trainer.step)

        def after_step(self, trainer, metrics):
            self.seen.append((trainer.step, "time/step_s" in metrics))
            return trainer.step == self.at

    stopper, watcher = Stop(2), Stop(-1)
    run = Run(tiny_config("rl.steps=5", "checkpoint.every=0"), tmp_path / "hooked")
    trainer = run.trainer()
    try:
        history = trainer.train(hooks=[watcher, stopper])
    finally:
        trainer.close()
    assert trainer.step == 2 and len(history) == 2
    assert stopper.begun == watcher.begun == [0]
    assert stopper.seen == watcher.seen == [(1, True), (2, True)]
    assert resolve_checkpoint(tmp_path / "hooked").name == "step_2"

    plain = Run(tiny_config("rl.steps=2", "checkpoint.every=0"), tmp_path / "plain").trainer()
    try:
        plain.train()
    finally:
        plain.close()
    assert computed_figures(tmp_path / "hooked") == computed_figures(tmp_path / "plain")
