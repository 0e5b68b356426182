"""ZVE and the curriculum inside the RL trainer, through the config."""

from __future__ import annotations

import json

import pytest
import torch

from everyprompt.cli import main
from everyprompt.data import DataError
from everyprompt.data.passrate import PassRateStore
from everyprompt.pipeline import Run, train
from everyprompt.pipeline.resume import resolve_checkpoint
from everyprompt.trainer.checkpoint import load_trainer_state
from tests.conftest import tiny_config

ALWAYS = "rewards.function=tests.trainer.flaky_reward:always"
BY_LEVEL = "rewards.function=tests.trainer.flaky_reward:by_level"
PARITY = "rewards.function=tests.trainer.flaky_reward:parity"


def _lines(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_zve_run_logs_every_stage_and_keeps_a_store(tmp_path):
    train(tiny_config("zve.enabled=true", "rl.steps=2", "zve.expansion.max_group_size=4"), run_dir=tmp_path)
    for line in _lines(tmp_path):
        for key in (
            "zve/zero_variance_rate",
            "zve/zero_variance_rate_expanded",
            "zve/zero_variance_rate_reshaped",
            "zve/zero_variance_rate_final",
            "zve/informative_rollout_fraction",
            "zve/signal_rollout_fraction",
            "zve/generated_rollouts",
            "zve/retired_total",
        ):
            assert key in line, key
        assert line["zve/generated_rollouts"] >= 4  # 2 prompts x 2 samples, more when expanded
    store = PassRateStore(tmp_path / "passrates.sqlite")
    assert len(store) >= 2
    assert load_trainer_state(resolve_checkpoint(tmp_path))["rollout"]["store"] == store.state_dict()


def test_all_correct_prompts_retire_and_are_not_drawn_again(tmp_path):
    config = tiny_config(ALWAYS, "zve.enabled=true", "zve.retirement.retire_after=1", "rl.steps=3")
    trainer = train(config, run_dir=tmp_path)
    lines = _lines(tmp_path)
    assert [line["zve/retired"] for line in lines] == [2.0, 2.0, 2.0]  # every visited prompt retires at once
    assert lines[-1]["zve/retired_total"] == 6
    retired = [
        p["prompt"]
        for p in trainer.rollout.prompts
        if not trainer.rollout.store.is_available(p["prompt"], 99)
    ]
    assert len(retired) == len(set(retired)) == 6  # six different prompts: none was drawn twice


def test_zvp_gives_all_correct_and_all_wrong_groups_token_advantages(tmp_path):
    config = tiny_config(
        BY_LEVEL, "zve.enabled=true", "zve.reshape.enabled=false", "zve.expansion.enabled=false", "rl.steps=1"
    )
    run = Run(config, tmp_path)
    trainer = run.trainer()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.train_step()
    assert metrics["zve/zero_variance_rate"] == 1.0  # by_level: every group is all-right or all-wrong
    assert metrics["zve/zvp_groups"] == 2 and metrics["zve/zero_variance_rate_final"] == 0.0
    assert (
        metrics["zve/informative_rollout_fraction"] == 1.0 and metrics["zve/signal_rollout_fraction"] == 0.0
    )
    assert metrics["actor/skipped_updates"] == 0
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_a_step_whose_groups_are_all_dropped_skips_the_update(tmp_path):
    config = tiny_config(
        ALWAYS, "zve.enabled=true", "zve.reshape.enabled=false", "zve.zvp.enabled=false", "rl.steps=1"
    )
    trainer = Run(config, tmp_path).trainer()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.train_step()
    assert metrics["actor/no_signal_update"] == 1.0 and metrics["zve/informative_rollout_fraction"] == 0.0
    assert metrics["zve/dropped_groups"] == 0 and metrics["zve/dropped_zero_variance_groups"] == 2
    assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


@pytest.mark.long  # 7 s on 2 cores: `make test-long`
def test_resume_with_zve_equals_an_uninterrupted_run(tmp_path):
    options = ("zve.enabled=true", "zve.retirement.retire_after=1", "zve.expansion.max_group_size=4")
    straight = train(tiny_config("rl.steps=4", *options), run_dir=tmp_path / "straight")
    train(tiny_config("rl.steps=2", *options), run_dir=tmp_path / "split")
    resumed = train(tiny_config("rl.steps=4", *options), run_dir=tmp_path / "split", resume=True)
    assert straight.rollout.store.state_dict() == resumed.rollout.store.state_dict()
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)


def test_curriculum_moves_from_stage_to_stage(tmp_path):
    stages = "curriculum.stages=[{mixture: {4: 1}, steps: 2}, {mixture: {5: 1}, max_new_tokens: 6}]"
    trainer = train(tiny_config(stages, "rl.steps=4", "checkpoint.every=0"), run_dir=tmp_path)
    lines = _lines(tmp_path)
    assert [line["curriculum/stage"] for line in lines] == [1, 1, 2, 2]
    assert [line["rollout/mean_length"] <= 6 for line in lines[2:]] == [True, True]
    assert trainer.rollout.curriculum.index == 1


def test_curriculum_advances_early_on_accuracy(tmp_path):
    stages = "curriculum.stages=[{mixture: {4: 1}, steps: 50, advance_accuracy: 0.5}, {mixture: {5: 1}}]"
    train(tiny_config(stages, ALWAYS, "curriculum.window=2", "rl.steps=3"), run_dir=tmp_path)
    assert [line["curriculum/stage"] for line in _lines(tmp_path)] == [1, 1, 2]  # window of 2 steps, not 50


def test_curriculum_bucket_without_prompts_is_a_clear_error(tmp_path):
    stages = "curriculum.stages=[{mixture: {9: 1}}]"
    with pytest.raises(DataError, match=r"bucket\(s\) \['9'\] with no prompts"):
        train(tiny_config(stages, "rl.steps=1"), run_dir=tmp_path)


def test_offline_filter_keeps_the_informative_prompts_and_survives_resume(tmp_path):
    options = ("zve.enabled=true", "zve.filter.enabled=true", "zve.filter.samples=4", PARITY)
    trainer = train(tiny_config("rl.steps=1", *options), run_dir=tmp_path)
    report = json.loads((tmp_path / "filter.json").read_text())
    assert (
        report["kept"] + report["too_easy"] + report["too_hard"] + report["unscored"] == report["estimated"]
    )
    assert len(trainer.rollout.prompts) == report["kept"] > 0
    assert report["rollouts"] == report["estimated"] * 4  # the filter's samples count in the run's total
    assert trainer.rollouts_total == report["rollouts"] + _lines(tmp_path)[0]["zve/generated_rollouts"]
    resumed = train(tiny_config("rl.steps=2", *options), run_dir=tmp_path, resume=True)
    assert [p["prompt"] for p in resumed.rollout.prompts] == [p["prompt"] for p in trainer.rollout.prompts]


def test_offline_filter_that_keeps_nothing_says_so(tmp_path):
    with pytest.raises(DataError, match="kept no prompt"):
        train(
            tiny_config(ALWAYS, "zve.enabled=true", "zve.filter.enabled=true", "rl.steps=1"), run_dir=tmp_path
        )


def test_filter_command_writes_kept_prompts_report_and_store(tmp_path, capsys):
    assert main(["sft", *tiny_config_overrides(), "--run-dir", str(tmp_path / "run")]) == 0
    out = tmp_path / "filtered"
    argv = [
        "filter",
        "builtin",
        *tiny_config_overrides(),
        "--model",
        str(tmp_path / "run" / "checkpoints" / "sft"),
    ]
    assert main([*argv, "--samples", "4", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    kept = (out / "kept.jsonl").read_text().splitlines()
    assert len(kept) == report["kept"]
    assert report["kept"] + report["too_easy"] + report["too_hard"] + report["unscored"] == report["prompts"]
    assert all(0 < json.loads(line)["pass_rate"] < 1 for line in kept)
    assert len(PassRateStore(out / "passrates.sqlite")) == report["prompts"] - report["unscored"]
    assert (out / "pass_rates.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "kept" in printed and "Pass rates by level" in printed
    # the built-in task's RL prompts carry their level: one row per level with every scored prompt in it
    assert (
        sum(row["prompts"] for row in report["by_level"].values()) == report["prompts"] - report["unscored"]
    )
    assert list(report["by_level"]) == sorted(report["by_level"], key=int)


def test_pass_rates_by_level_hand_computed():
    from everyprompt.zve.offline import PassRateEstimate

    # level 1: 0/4 and 2/4; level 2: 4/4 (and a prompt never scored); a row without a level is left out
    estimate = PassRateEstimate([4, 4, 4, 0, 4], [0, 2, 4, 0, 1], [1.0] * 5, 0)
    rows = [{"level": 1}, {"level": 1}, {"level": 2}, {"level": 2}, {}]
    assert estimate.by_level(rows) == {
        "1": {
            "prompts": 2,
            "mean_pass_rate": 0.25,
            "never_solved": 0.5,
            "always_solved": 0.0,
            "in_band": 0.5,
        },
        "2": {"prompts": 1, "mean_pass_rate": 1.0, "never_solved": 0.0, "always_solved": 1.0, "in_band": 0.0},
    }


def tiny_config_overrides():
    from tests.conftest import TINY_OVERRIDES

    return list(TINY_OVERRIDES)


def test_a_rollout_budget_stops_the_run(tmp_path):
    trainer = train(tiny_config("rl.steps=10", "rl.max_rollouts=8"), run_dir=tmp_path)  # 2 prompts x 2 a step
    assert trainer.step == 2 and trainer.rollouts_total == 8
    assert [line["rollout/total"] for line in _lines(tmp_path)] == [4, 8]
