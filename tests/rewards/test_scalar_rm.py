"""Scalar reward model: a sequence-classification checkpoint scores responses; a run uses it with the
dead zone."""

import json

import pytest
import torch

from tests.conftest import TINY_LAYERS


@pytest.fixture
def rm_dir(tmp_path):
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    from everyprompt.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        intermediate_size=32,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        **TINY_LAYERS,
    )
    torch.manual_seed(0)
    model = Qwen3ForSequenceClassification(config)
    path = tmp_path / "rm"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_scores_do_not_depend_on_the_batch(rm_dir):
    from everyprompt.rewards import ScalarRM

    completions, prompts = ["42", "forty-two", "41 is wrong", "4"], ["6*7="] * 4
    together = ScalarRM(str(rm_dir), batch_size=4)(completions, prompt=prompts)
    alone = [ScalarRM(str(rm_dir), batch_size=1)([c], prompt=["6*7="])[0] for c in completions]
    assert all(isinstance(s, float) for s in together)
    assert len(set(together)) == 4  # a random model still tells these apart
    torch.testing.assert_close(torch.tensor(together), torch.tensor(alone), atol=1e-5, rtol=0)


def test_bad_scalar_rm_settings(rm_dir, tmp_path):
    from everyprompt.config import ConfigError, load_config
    from everyprompt.models.io import ModelError
    from everyprompt.rewards import ScalarRM

    with pytest.raises(ValueError, match=r"no \{response\} field"):
        ScalarRM(str(rm_dir), "{question}")
    with pytest.raises(ModelError, match="no config.json"):
        ScalarRM(str(tmp_path / "missing"))(["a"], prompt=["q"])
    with pytest.raises(ConfigError, match="needs rewards.scalar_rm.model"):
        load_config(None, ["rewards.function=scalar_rm"])


def test_a_scalar_rm_run_with_the_dead_zone(rm_dir, tmp_path):
    from everyprompt.pipeline import train
    from tests.conftest import tiny_config

    config = tiny_config(
        "rl.steps=1", "rewards.function=scalar_rm", f"rewards.scalar_rm.model={rm_dir}", "rl.dead_zone=0.01"
    )
    train(config, run_dir=tmp_path)
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert line["reward/errors"] == 0 and line["reward/none_fraction"] == 0  # scored in the worker


def test_a_reward_model_named_by_its_hub_id_scores_a_run(rm_dir, offline_cache, tmp_path):
    import yaml

    from everyprompt.pipeline import train
    from tests.conftest import cache_repo, tiny_config

    commit = "e" * 40
    cache_repo(offline_cache, "org/rm", rm_dir, commit)
    config = tiny_config("rl.steps=1", "rewards.function=scalar_rm", "rewards.scalar_rm.model=org/rm")
    train(config, run_dir=tmp_path / "run")
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert line["reward/errors"] == 0 and line["reward/none_fraction"] == 0  # the worker found the snapshot
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["rewards"]["scalar_rm"]["model"] == f"org/rm@{commit}"
