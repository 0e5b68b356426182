"""GDPO (algorithms/advantages.py) by hand, and a run whose advantages come from its reward's components."""

from __future__ import annotations

import json
import math

import pytest
import torch

from everyprompt.algorithms import compute_advantages
from everyprompt.trainer.rollout_side.assemble import reward_components


def test_two_components_of_different_scales_each_get_their_say():
    group = torch.zeros(4, dtype=torch.long)
    accuracy = torch.tensor([1.0, 0.0, 1.0, 0.0])  # scale 1
    length = torch.tensor([0.0, 10.0, 10.0, 0.0])  # scale 10
    components = torch.stack([accuracy, length], dim=1)
    # per component: mean 0.5, std sqrt(1/3) -> +-0.8660; mean 5, std sqrt(100/3) -> +-0.8660
    # sum: [0, 0, 1.7321, -1.7321]; over the batch: mean 0, std sqrt(6/3) = 1.4142 -> [0, 0, 1.2247, -1.2247]
    gdpo = compute_advantages("gdpo", accuracy + length, group, components=components, eps=0.0)
    assert gdpo.tolist() == pytest.approx([0.0, 0.0, math.sqrt(1.5), -math.sqrt(1.5)])
    # GRPO on the summed reward [1, 10, 11, 0]: the length component decides the order
    grpo = compute_advantages("grpo", accuracy + length, group)
    assert grpo[1] > 0 > grpo[0]  # the wrong, long answer above the right, short one
    assert gdpo[1] == pytest.approx(gdpo[0])  # GDPO: one component for each, they cancel
    weighted = compute_advantages("gdpo", accuracy + length, group, components=components, weights=[2.0, 1.0])
    assert weighted[0] > weighted[1]  # accuracy weighted twice: the right answer comes first


def test_a_missing_component_is_left_out_and_a_missing_total_gets_zero():
    group = torch.tensor([0, 0, 0, 1, 1])
    components = torch.tensor([[1.0, 0.0], [0.0, math.nan], [1.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    rewards = torch.tensor([1.0, math.nan, 2.0, 0.0, 1.0])
    out = compute_advantages("gdpo", rewards, group, components=components, eps=1e-6)
    assert out[1] == 0.0  # its total is None
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="2 weights for 3 reward components|3 reward components"):
        compute_advantages("gdpo", rewards, group, components=torch.zeros(5, 3), weights=[1.0, 1.0])


def test_the_batch_carries_each_component_nan_where_a_row_has_none():
    parts = [{"math": 1.0, "parity": 0.0}, None, {"math": None, "parity": 1.0}]
    out = reward_components(parts)
    assert sorted(out) == ["math", "parity"]
    assert out["math"].tolist()[0] == 1.0 and math.isnan(out["math"][1]) and math.isnan(out["math"][2])
    assert reward_components([None, None]) == {}


def test_gdpo_without_components_is_a_config_error_naming_the_key():
    from everyprompt.config import ConfigError, load_config

    with pytest.raises(
        ConfigError, match=r"rl.advantage=gdpo .* needs rewards.components with two or more \(got 0\)"
    ):
        load_config(None, ["rl.advantage=gdpo"])
    with pytest.raises(ConfigError, match=r"\(got 1\)"):
        load_config(None, ["rl.advantage=gdpo", "rewards.components=[{name: math, function: math}]"])


def test_a_one_step_run_with_gdpo_advantages(tmp_path):
    from everyprompt.pipeline import train
    from tests.conftest import tiny_config

    config = tiny_config(
        "rl.steps=1",
        "rl.advantage=gdpo",
        "rewards.components=[{name: math, function: math, weight: 1.0}, "
        "{name: parity, function: 'tests.trainer.flaky_reward:parity', weight: 0.5}]",
    )
    train(config, run_dir=tmp_path)
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert 0 <= line["reward/parity"] <= 1 and math.isfinite(line["loss/policy"])


def test_a_driven_run_refuses_gdpo_its_batches_carry_no_components():
    from everyprompt.config import ConfigError, load_config

    parts = "rewards.components=[{name: a, function: math}, {name: b, function: math}]"
    with pytest.raises(ConfigError, match=r"external.enabled: .* so rl.advantage=gdpo does not apply"):
        load_config(None, ["external.enabled=true", "rl.advantage=gdpo", parts, "rl.max_staleness=0"])
