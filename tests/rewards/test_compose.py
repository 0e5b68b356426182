"""Reward composition: weights, the missing-component rule, per-component logging."""

import json

import pytest

from everyprompt.rewards import CompositeReward


def exact(completions, answer, **_):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def short(completions, **_):
    return [None if c == "?" else float(len(c) <= 3) for c in completions]


def test_weighted_sum_and_the_missing_rule():
    completions, answer = ["42", "41", "4242", "?"], ["42"] * 4
    # exact: 1, 0, 0, 0; short: 1, 1, 0, None
    # weights 1.0 and 0.5: 1.5, 0.5, 0.0, and for the last row skip -> None, zero -> 0 + 0.5 * 0 = 0.0
    skip = CompositeReward([("exact", exact, 1.0), ("short", short, 0.5)], "skip")
    totals, rows, failed = skip.score_with_components(completions, answer=answer)
    assert totals == [1.5, 0.5, 0.0, None] and failed == []
    assert rows[3] == {"exact": 0.0, "short": None}
    zero = CompositeReward([("exact", exact, 1.0), ("short", short, 0.5)], "zero")
    assert zero(completions, answer=answer) == [1.5, 0.5, 0.0, 0.0]
    only_missing = CompositeReward([("short", short, 1.0)], "zero")
    assert only_missing(["?"]) == [None]  # nothing scored at all stays None


def test_bad_compositions_are_clear_errors():
    from everyprompt.config import ConfigError, load_config

    with pytest.raises(ValueError, match="at least one component"):
        CompositeReward([])
    with pytest.raises(ValueError, match="unique"):
        CompositeReward([("a", exact, 1.0), ("a", short, 1.0)])
    with pytest.raises(ConfigError, match="clash with the reward"):
        load_config(None, ["rewards.components=[{name: accuracy, function: math}]"])
    with pytest.raises(ConfigError, match="needs rewards.genrm.model"):
        load_config(None, ["rewards.components=[{name: judge, function: genrm}]"])


def test_a_composite_run_logs_each_component(tmp_path):
    from everyprompt.pipeline import train
    from tests.conftest import tiny_config

    config = tiny_config(
        "rl.steps=1",
        "rewards.components=[{name: math, function: math, weight: 1.0}, "
        "{name: parity, function: 'tests.trainer.flaky_reward:parity', weight: 0.1}]",
    )
    train(config, run_dir=tmp_path)
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert 0 <= line["reward/math"] <= 1 and 0 <= line["reward/parity"] <= 1
    # the total is the weighted sum of the two means (no row is None here)
    assert line["reward/mean"] == pytest.approx(line["reward/math"] + 0.1 * line["reward/parity"], abs=1e-6)
