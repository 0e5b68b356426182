import json

import pytest
import torch

from everyprompt.pipeline import Run, train
from everyprompt.trainer.batch import RolloutBatch
from everyprompt.trainer.checkpoint import CheckpointError, load_trainer_state, resolve_checkpoint
from everyprompt.trainer.rl import zero_variance_rate
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
        "time/rollout_s",
        "time/train_s",
        "loss/policy",
        "actor/clip_fraction",
        "actor/entropy",
        "actor/grad_norm",
    ):
        assert key in lines[0], key
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


def test_truncated_checkpoint_is_a_clear_error(tmp_path):
    train(tiny_config("rl.steps=1"), run_dir=tmp_path)
    (resolve_checkpoint(tmp_path) / "trainer_state.pt").write_bytes(b"\x80\x02trunc")
    with pytest.raises(CheckpointError, match="trainer_state.pt: cannot be read"):
        Run(tiny_config(), tmp_path).trainer(resume=True)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        resolve_checkpoint(tmp_path / "nowhere")


def test_reward_errors_are_counted_not_fatal(tmp_path):
    trainer = train(
        tiny_config("rl.steps=1", "rewards.function=tests.trainer.flaky_reward:flaky"), run_dir=tmp_path
    )
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert trainer.reward_errors == line["reward/errors"] > 0
    assert line["reward/none_fraction"] > 0


def test_update_moves_log_probs_along_the_advantages(tmp_path):
    """One update must raise sum_i A_i * logp(y_i): correct completions up, wrong ones down."""
    from everyprompt.trainer.logprobs import token_logprobs

    trainer = Run(tiny_config("rl.lr=1e-3", "rl.mini_batches=1"), tmp_path).trainer()
    batch = trainer.rollout()
    batch.rewards = torch.tensor([1.0, 0.0] * (len(batch) // 2))
    batch.advantages = torch.tensor([1.0, -1.0] * (len(batch) // 2))

    def objective() -> float:
        data = batch.padded(list(range(len(batch))), trainer.tokenizer.pad_token_id)
        with torch.no_grad():
            logp, _ = token_logprobs(trainer.model, data["input_ids"])
        return float(((logp * data["mask"]).sum(-1) * batch.advantages).sum())

    before = objective()
    trainer.update(batch)
    assert objective() > before + 1e-3
