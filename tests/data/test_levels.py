"""Each reasoning-gym task climbs its own curriculum's levels by its recent pass rate: the moves by hand,
the levels in each step's metrics, and a resumed run equal to an uninterrupted one."""

from __future__ import annotations

import json

import pytest

from everyprompt.config import TaskLevelsConfig
from everyprompt.data.levels import TaskLevels, TaskMix


def levels(**options) -> TaskLevels:
    config = TaskLevelsConfig(enabled=True, window=2, promote=0.75, demote=0.25, **options)
    return TaskLevels({"a": 1.0, "b": 3.0}, {"a": [0, 1, 2], "b": [1, 2]}, config)


def test_a_full_window_at_or_past_a_threshold_moves_its_task_one_level():
    plan = levels()
    assert plan.mixture() == {"a@0": 1.0, "b@1": 3.0}
    stats = plan.observe([("a", 0, 1.0), ("b", 1, 0.5)])  # windows not full: nothing moves
    assert plan.level == {"a": 0, "b": 1} and stats["curriculum/level/a"] == 0.0
    assert stats["tasks/a/pass_rate"] == 1.0 and stats["tasks/b/pass_rate"] == 0.5
    plan.observe([("a", 0, 0.5), ("b", 1, 0.5)])  # a: mean 0.75 = promote -> up; b: 0.5 holds
    assert (
        plan.level == {"a": 1, "b": 1}
        and list(plan.recent["a"]) == []
        and list(plan.recent["b"]) == [0.5, 0.5]
    )
    assert plan.mixture() == {"a@1": 1.0, "b@1": 3.0}
    plan.observe([("a", 0, 1.0), ("a", 1, 0.25), ("b", 1, 0.0)])  # a's group of level 0 is not counted
    assert (
        list(plan.recent["a"]) == [0.25] and plan.level["b"] == 1
    )  # b: mean 0.25 = demote, but at its floor
    stats = plan.observe([("a", 1, 0.0)])  # a: mean 0.125 <= 0.25 -> down
    assert plan.level["a"] == 0 and stats["curriculum/level/a"] == 1.0  # the level this step drew from
    assert stats["curriculum/level_moves"] == 2.0


def test_a_task_at_its_top_stays_there():
    plan = levels()
    for _ in range(6):
        plan.observe([("b", plan.level["b"], 1.0)])
    assert plan.level["b"] == 2 and plan.moves == 1


def test_the_state_round_trips_and_a_foreign_one_is_refused():
    plan = levels()
    plan.observe([("a", 0, 1.0), ("a", 0, 1.0), ("b", 1, 0.5)])
    state = json.loads(json.dumps(plan.state_dict()))
    other = levels()
    other.load_state_dict(state)
    assert other.level == plan.level and other.recent == plan.recent and other.moves == plan.moves
    with pytest.raises(ValueError, match="task a at level 7"):
        levels().load_state_dict({**state, "level": {"a": 7, "b": 1}})
    with pytest.raises(ValueError, match="tasks \\['a'\\]"):
        levels().load_state_dict({**state, "level": {"a": 0}})


def test_a_fixed_mix_weighs_each_task_at_its_level():
    mix = TaskMix({"a": 2.0, "b": 1.0}, {"a": 3, "b": None})
    assert mix.mixture() == {"a@3": 2.0, "b": 1.0}
    assert mix.observe([("a", 3, 0.5), ("a", 3, 1.0)]) == {"tasks/a/pass_rate": 0.75}
