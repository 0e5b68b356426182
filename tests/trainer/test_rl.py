import json
import math

import pytest
import torch
from safetensors import SafetensorError

from everyprompt.batch import RolloutBatch
from everyprompt.pipeline import Run, train
from everyprompt.run.resume import resolve_checkpoint
from everyprompt.trainer.checkpoint import CheckpointError, load_trainer_state
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


def test_resume_equals_an_uninterrupted_run(tmp_path):
    straight = train(tiny_config("rl.steps=4"), run_dir=tmp_path / "straight")
    first = train(tiny_config("rl.steps=2"), run_dir=tmp_path / "split")
    assert first.step == 2
    resumed = train(tiny_config("rl.steps=4"), run_dir=tmp_path / "split", resume=True)
    assert resumed.step == 4
    a, b = _parameters(straight.model), _parameters(resumed.model)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)


def test_the_engine_sleeps_while_the_learner_updates_and_the_run_is_unchanged(tmp_path, monkeypatch):
    from everyprompt.trainer.learner import Learner

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


def test_a_damaged_checkpoint_is_named_and_the_run_resumes_from_the_newest_complete_one(tmp_path, caplog):
    train(tiny_config("rl.steps=2"), run_dir=tmp_path)  # step_1 and step_2 (latest)
    state = resolve_checkpoint(tmp_path) / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:-100])  # truncated
    trainer = Run(tiny_config(), tmp_path).trainer(resume=True)
    assert trainer.step == 1
    assert "step_2/trainer_state.pt" in caplog.text and "truncated or altered" in caplog.text
    # the other one altered, same size: nothing complete is left
    weights = tmp_path / "checkpoints" / "step_1" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=r"no complete checkpoint to resume from.*model.safetensors: checksum"
    ):
        Run(tiny_config(), tmp_path).trainer(resume=True)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        resolve_checkpoint(tmp_path / "nowhere")


FULL_DISK = {  # how a full disk reaches save_checkpoint: from the OS, and from safetensors' own writer
    "oserror": lambda: OSError(28, "No space left on device"),
    "safetensors": lambda: SafetensorError(
        "Error while serializing: I/O error: No space left on device (os error 28)"
    ),
}


@pytest.mark.parametrize("source", sorted(FULL_DISK))
def test_an_unwritable_checkpoint_directory_fails_at_once_and_keeps_the_previous_one(
    tmp_path, monkeypatch, source
):
    import everyprompt.trainer.checkpoint as checkpoint_module
    from everyprompt.trainer.checkpoint import verify_checkpoint

    trainer = train(tiny_config("rl.steps=1"), run_dir=tmp_path)
    real_save = checkpoint_module.save_pretrained

    def full_disk(model, tokenizer, path, merged=False):
        real_save(model, tokenizer, path, merged)
        raise FULL_DISK[source]()

    monkeypatch.setattr(checkpoint_module, "save_pretrained", full_disk)
    trainer.step = 2
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint .*step_2: .*No space left on device"):
        trainer.save()
    assert resolve_checkpoint(tmp_path).name == "step_1"
    verify_checkpoint(resolve_checkpoint(tmp_path))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "sft", "step_1"]


def test_a_checkpoint_write_that_fails_otherwise_leaves_no_half_written_copy(tmp_path, monkeypatch):
    import everyprompt.trainer.checkpoint as checkpoint_module

    trainer = train(tiny_config("rl.steps=1"), run_dir=tmp_path)
    real_save = checkpoint_module.save_pretrained

    def interrupted(model, tokenizer, path, merged=False):
        real_save(model, tokenizer, path, merged)
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_module, "save_pretrained", interrupted)
    trainer.step = 2
    with pytest.raises(KeyboardInterrupt):
        trainer.save()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "sft", "step_1"]


def test_a_disk_too_full_for_the_next_checkpoint_is_warned_of_when_this_one_is_written(
    tmp_path, monkeypatch, caplog
):
    import collections
    import shutil

    trainer = train(tiny_config("rl.steps=1"), run_dir=tmp_path)
    written = resolve_checkpoint(tmp_path)  # the next one is as large: every file but the manifest
    size = sum(f.stat().st_size for f in written.rglob("*") if f.is_file() and f.name != "manifest.json")
    usage = collections.namedtuple("usage", "total used free")
    for free, warned in [(10 * size, False), (size - 1, True)]:
        monkeypatch.setattr(shutil, "disk_usage", lambda path, free=free: usage(0, 0, free))
        caplog.clear()
        trainer.step += 1
        with caplog.at_level("WARNING", logger="everyprompt.trainer.checkpoint"):
            trainer.save()
        assert ("the next checkpoint will not fit" in caplog.text) is warned, (free, caplog.text)
    assert f"step_{trainer.step} takes {size / 1e9:.2f} GB and only {(size - 1) / 1e9:.2f} GB" in caplog.text


def test_a_run_directory_that_cannot_be_written_is_named_at_once(tmp_path, capsys):
    from everyprompt.cli import main
    from tests.conftest import TINY_OVERRIDES

    (tmp_path / "file").write_text("not a directory")
    assert main(["train", *TINY_OVERRIDES, "--run-dir", str(tmp_path / "file" / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("everyprompt: ")
        and f"{tmp_path / 'file' / 'run'}: cannot write the run directory" in err
    )


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
    from everyprompt.trainer.logprobs import token_logprobs

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
    import everyprompt.trainer.learner as learner_module
    from everyprompt.trainer.logprobs import token_logprobs

    config = tiny_config("rl.loss=espo", "rl.lr=1e-2", f"rl.old_logprobs={old_logprobs}")
    trainer = Run(config, tmp_path).trainer()
    batch = trainer.rollout.next_batch(0)
    batch.rewards = torch.arange(len(batch), dtype=torch.float32)  # every group informative
    data = batch.padded(list(range(len(batch))), trainer.tokenizer.pad_token_id)
    with torch.no_grad():
        _, before = token_logprobs(trainer.model, data["input_ids"], with_entropy=True)
    seen = []
    real_policy_loss = learner_module.policy_loss

    def spy(*args, entropy=None, **kwargs):
        seen.append((entropy.detach().clone(), kwargs["rollout_logp"]))
        return real_policy_loss(*args, entropy=entropy, **kwargs)

    monkeypatch.setattr(learner_module, "policy_loss", spy)
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
    trainer.learner._rollout_as_old(batch)
    assert batch.old_logprobs is batch.rollout_logprobs
    torch.testing.assert_close(torch.cat(batch.old_logprobs), recomputed[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat(batch.old_entropies), recomputed[1], atol=1e-5, rtol=0)


def test_kl_reference_is_the_starting_policy_after_resume(tmp_path):
    options = ("rl.kl.estimator=k2", "rl.lr=1e-2", "rewards.function=tests.trainer.flaky_reward:parity")
    train(tiny_config("rl.steps=1", *options), run_dir=tmp_path)
    start = Run(tiny_config(), tmp_path).warm_started_model()[0]
    resumed = Run(tiny_config("rl.steps=2", *options), tmp_path).trainer(resume=True)
    torch.testing.assert_close(resumed.learner.reference.state_dict(), start.state_dict())
    moved = resumed.model.model.embed_tokens.weight
    assert not torch.allclose(moved, resumed.learner.reference.model.embed_tokens.weight)


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


@pytest.mark.parametrize("pack", ["true", "false"])
def test_r3_replays_the_engines_routes_in_the_trainer(tmp_path, pack):
    """Engine routes ride in the batch; the replayed old-policy pass matches the engine and uses them."""
    config = tiny_config("rl.router_replay=r3", "rl.old_logprobs=recompute", f"model.pack_sequences={pack}")
    trainer = Run(config, tmp_path).trainer()
    batch = trainer.rollout.next_batch(0)
    layers, top_k = trainer.model.config.num_hidden_layers, trainer.model.config.num_experts_per_tok
    for prompt, completion, routes in zip(batch.prompt_ids, batch.completion_ids, batch.routed_experts):
        assert routes.shape == (len(prompt) + len(completion) - 1, layers, top_k)
    data = batch.padded(list(range(len(batch))), trainer.tokenizer.pad_token_id)
    recorded = []
    with torch.no_grad():
        logp, _ = trainer.learner.forward(data, slice(None), False, recorded, "routes")
    engine = torch.cat([r for r in batch.rollout_logprobs])
    torch.testing.assert_close(
        torch.cat(batch.completion_values(list(range(len(batch))), logp)), engine, atol=1e-5, rtol=0
    )
    for used, given in zip(recorded, batch.routed_experts):
        n = len(given)
        assert torch.equal(used[:n].long().sort(-1).values, given.long().sort(-1).values)  # agreement 1.0


def test_r2_needs_the_old_policy_pass():
    from everyprompt.config import ConfigError

    with pytest.raises(ConfigError, match="set rl.old_logprobs=recompute or use r3"):
        tiny_config("rl.router_replay=r2", "rl.old_logprobs=rollout")


@pytest.mark.parametrize("replay", ["off", "r3"])
def test_mismatch_metrics_are_logged_with_the_old_policy_pass(tmp_path, replay):
    config = tiny_config("rl.steps=1", "rl.old_logprobs=recompute", f"rl.router_replay={replay}")
    train(config, run_dir=tmp_path)
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert line["mismatch/logp_abs_diff"] < 1e-4  # fp32 engine and trainer, same weights
    assert abs(line["mismatch/k3_kl"]) < 1e-6 and line["mismatch/ratio_above_2"] == 0
    assert line["mismatch/routing_agreement"] == 1.0 and line["mismatch/flipped_token_fraction"] == 0


def test_mismatch_metrics_hand_computed():
    from everyprompt.trainer.mismatch import mismatch_metrics

    engine_routes = [torch.tensor([[[0, 1]], [[2, 3]], [[0, 2]]], dtype=torch.int16)]  # 3 fed tokens, 1 layer
    trainer_routes = [torch.tensor([[[1, 0]], [[2, 3]], [[0, 3]]], dtype=torch.int16)]  # last token flipped
    metrics = mismatch_metrics(
        [2],  # prompt of 2 tokens, completion of 2
        [torch.tensor([-1.0, -2.0 + math.log(3)])],  # trainer: second token's ratio is 3
        [torch.tensor([-1.0, -2.0])],
        trainer_routes,
        engine_routes,
    )
    # |dlogp| = (0 + ln 3) / 2; k3 = ((1 - 1 - 0) + (3 - 1 - ln 3)) / 2; ratio > 2 on 1 of 2 tokens
    assert metrics["mismatch/logp_abs_diff"] == pytest.approx(math.log(3) / 2)
    assert metrics["mismatch/k3_kl"] == pytest.approx((2 - math.log(3)) / 2)
    assert metrics["mismatch/ratio_above_2"] == 0.5
    # pairs: token 0 same set {0,1}, token 1 same, token 2 {0,2} vs {0,3} differs -> 2 of 3
    assert metrics["mismatch/routing_agreement"] == pytest.approx(2 / 3)
    # completion targets are predicted from fed tokens 1 and 2: token 2 flipped -> the second target
    assert metrics["mismatch/flipped_token_fraction"] == 0.5
    assert metrics["mismatch/logp_abs_diff_flipped"] == pytest.approx(math.log(3))
    assert metrics["mismatch/logp_abs_diff_unflipped"] == 0.0


def test_fp8_rollouts_with_rollout_logprobs_are_refused():
    from everyprompt.config import ConfigError

    with pytest.raises(ConfigError, match="with rollout.precision=fp8 set rl.old_logprobs=recompute"):
        tiny_config("rollout.precision=fp8")  # the demo config uses rl.old_logprobs=rollout


def test_fp8_rollouts_show_in_the_mismatch_metrics(tmp_path):
    config = tiny_config("rl.steps=1", "rl.old_logprobs=recompute", "rollout.precision=fp8")
    train(config, run_dir=tmp_path)
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert line["mismatch/logp_abs_diff"] > 1e-4  # fp8 engine vs fp32 trainer: measured, not hidden


class _Payload:
    """Pickles to a call that touches a file: what a malicious checkpoint would do on load."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_a_checkpoint_that_would_run_code_is_refused_unopened(tmp_path):
    train(tiny_config("rl.steps=1"), run_dir=tmp_path)
    marker = tmp_path / "pwned"
    state_file = resolve_checkpoint(tmp_path) / "trainer_state.pt"
    state = load_trainer_state(resolve_checkpoint(tmp_path))  # a real state loads with weights_only
    assert state["step"] == 1
    torch.save({**state, "extra": _Payload(str(marker))}, state_file)
    with pytest.raises(CheckpointError, match="trainer_state.pt: cannot be read"):
        load_trainer_state(resolve_checkpoint(tmp_path))
    assert not marker.exists()


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


def test_a_run_whose_updates_stay_non_finite_stops_and_names_its_last_checkpoint(
    tmp_path, monkeypatch, capsys
):
    from everyprompt.cli import main
    from everyprompt.trainer.learner import Learner
    from tests.conftest import TINY_OVERRIDES

    real_optimize = Learner._optimize

    def poisoned(self, batch):  # from the third update on, every gradient is infinite
        if self.version >= 2 and not getattr(self, "_poisoned", False):
            self.model.lm_head.weight.register_hook(lambda grad: torch.full_like(grad, float("inf")))
            self._poisoned = True
        return real_optimize(self, batch)

    monkeypatch.setattr(Learner, "_optimize", poisoned)
    signal = "rewards.function=tests.trainer.flaky_reward:scattered"  # every step has something to update
    argv = [
        "train",
        *TINY_OVERRIDES,
        signal,
        "rl.steps=6",
        "rl.max_skipped_updates=2",
        "--run-dir",
        str(tmp_path),
    ]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "2 updates in a row were skipped" in err and "Traceback" not in err
    assert f"last good state is {(tmp_path / 'checkpoints' / 'step_2').resolve()}" in err


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
    assert not learner.optimizer.state  # Adam never stepped: no moments to replay
    assert learner.scheduler.last_epoch == 0  # no schedule tick either
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
    assert trainer.learner.scheduler.last_epoch == 1 and trainer.learner.optimizer.state
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert line["actor/no_signal_update"] == 0.0 and "loss/policy" in line
