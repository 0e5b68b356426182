"""Every task of the installed reasoning-gym: its rows are made, written as JSON and read back (as a run's
data, journals and reward workers see them), and its gold answer, given as the model would give it, scores
full marks through the project's reward; or the config refuses the task, by name, with the reason. Items
whose scorer needs the library's own types (enums, dates, nested configs, tuple grids) are made again
from the row's recipe (data/gym.py)."""

from __future__ import annotations

import json

import pytest

reasoning_gym = pytest.importorskip(
    "reasoning_gym", reason="reasoning-gym is the optional extra everyprompt[tasks]"
)

from reasoning_gym.factory import DATASETS  # noqa: E402

from everyprompt.config import ConfigError, GymTaskConfig  # noqa: E402
from everyprompt.data.gym import NONSENSE, Recipe, check_scorer, make_items, task_config  # noqa: E402
from everyprompt.rewards.gym import reasoning_gym_reward  # noqa: E402

# tasks without an `answer`: their reference solution, where the item has one, is in its metadata
EXAMPLE_FIELDS = ("possible_answer", "example_answer", "example_correct_answer")
# tasks whose items carry no reference solution at all: the scorer checks any answer by playing it out
OPEN_ENDED = {
    "boxnet": "the scorer plays out the answer's moves; no reference plan is made",
    "rush_hour": "the scorer plays out the answer's moves; the item gives only the fewest moves",
}
# tasks the config refuses, with the reason the message must name
REFUSED = {
    "composite": "Must specify at least one dataset",  # a mix of other tasks: name those instead
    "game_of_life_halting": "gives full marks to a nonsense answer",  # bool("False") is True
}
# tasks whose scorer raises on an answer it cannot read (the run scores that row None and reports it)
RAISES_ON_NONSENSE = {"prime_factorization": ValueError}


def _gold(entry: dict) -> str | None:
    if entry.get("answer") is not None:
        return str(entry["answer"])
    metadata = entry.get("metadata", {})
    for field in EXAMPLE_FIELDS:
        if field in metadata:
            value = metadata[field]
            return value if isinstance(value, str) else json.dumps(value)
    return None


def test_every_installed_task_is_covered():
    assert len(DATASETS) >= 100  # reasoning-gym 0.1.25 has 106
    assert set(REFUSED) | set(OPEN_ENDED) <= set(DATASETS)


@pytest.mark.long  # 19 s on 2 cores: `make test-long`
@pytest.mark.parametrize("task", sorted(DATASETS))
def test_each_task_scores_its_gold_answer_after_a_json_round_trip(task):
    recipe = Recipe(task, None, {}, 1234, 2)
    if task in REFUSED:  # by the config's check of each task (GymRows), before any work
        with pytest.raises(ConfigError, match=rf"tasks\.{task}'.*{REFUSED[task]}"):
            check_scorer(task, task_config(task, GymTaskConfig(), None), None)
        return
    check_scorer(task, recipe.config(), None)
    rows = json.loads(json.dumps(make_items(recipe, 2, set())))
    items = [row["gym"] for row in rows]
    if task in RAISES_ON_NONSENSE:
        with pytest.raises(RAISES_ON_NONSENSE[task]):
            reasoning_gym_reward([f"<answer>{NONSENSE}</answer>"], gym=items[:1])
    else:
        wrong = reasoning_gym_reward([f"<answer>{NONSENSE}</answer>"] * 2, gym=items)
        assert all(0.0 <= score < 1.0 for score in wrong)
    if task in OPEN_ENDED:
        assert all(_gold(item["entry"]) is None for item in items)
        return
    gold = [f"<answer>{_gold(item['entry'])}</answer>" for item in items]
    assert reasoning_gym_reward(gold, gym=items) == [1.0, 1.0]


def test_a_row_whose_item_the_recipe_no_longer_makes_is_an_error_naming_the_task():
    (row,) = make_items(Recipe("leg_counting", None, {}, 7, 1), 1, set())
    row["gym"]["entry"]["question"] = "another question"
    with pytest.raises(RuntimeError, match="leg_counting made its item 0 differently"):
        reasoning_gym_reward(["<answer>1</answer>"], gym=[row["gym"]])
