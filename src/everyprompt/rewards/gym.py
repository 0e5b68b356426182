"""The `reasoning_gym` reward: each reasoning-gym task's own scorer (`score_answer`) on the model's answer.

A row made by data/gym.py carries `gym`: the task, the config its item was made with, the item's index
(the item is made again from them, in the library's own types, once per worker) and how the answer is read
(`data.reasoning_gym.answer`). The scorer is the task's dataset built with that same config, one per task
and config in each reward worker. A row without `gym` (not a reasoning-gym item) gets None, so the reward
composes with others (`rewards.components`).
"""

from __future__ import annotations

import dataclasses
import json
from functools import lru_cache

from everyprompt.data.gym import Recipe, library
from everyprompt.rewards.base import register_reward
from everyprompt.rewards.math import extract_answer, plain_number

RECIPE_FIELDS = tuple(field.name for field in dataclasses.fields(Recipe))
READINGS = ("auto", "tags", "final")


def read_answer(completion: str, how: str = "auto") -> str | None:
    """The answer handed to the task's scorer: the last `<answer>...</answer>` (tags, reasoning-gym's own
    reading), the math reward's final answer (final), or the tags when there are any, else final (auto)."""
    if how not in READINGS:
        raise ValueError(f"unknown answer reading {how!r}; expected one of {', '.join(READINGS)}")
    if how != "final":
        library()
        from reasoning_gym.utils import extract_answer as tagged

        found = tagged(completion)
        if found is not None or how == "tags":
            return found
    final = extract_answer(completion)
    return None if final is None else plain_number(final.strip())


@lru_cache(maxsize=64)
def _scorer(task: str, config: str):
    library()
    from reasoning_gym.factory import DATASETS

    dataset_cls, config_cls = DATASETS[task]
    return dataset_cls(config=config_cls(**json.loads(config))).score_answer


@lru_cache(maxsize=64)
def _dataset(recipe: str):
    return Recipe(**json.loads(recipe)).dataset()


@lru_cache(maxsize=4096)
def _made(recipe: str, index: int, question: str) -> tuple:
    """(the item the row's recipe makes at `index`, its dataset's scorer); an error when that item is not
    the row's question (a task whose items do not follow from their seed)."""
    dataset = _dataset(recipe)
    entry = dataset[index]
    if entry["question"] != question:
        task = json.loads(recipe)["task"]
        raise RuntimeError(
            f"reasoning-gym's {task} made its item {index} differently from the row's: it cannot be scored "
            "(the task's items do not follow from its seed)"
        )
    return entry, dataset.score_answer


def score_item(completion: str, item: dict) -> float:
    """The task's own score of `completion` for one row's `gym` item."""
    answer = read_answer(completion, item.get("read", "auto"))
    if "index" not in item:  # a row written before rows carried their recipe: the item as JSON kept it
        scorer = _scorer(item["task"], json.dumps(item["config"], sort_keys=True))
        return float(scorer(answer, item["entry"]))
    recipe = {key: item[key] for key in RECIPE_FIELDS}
    entry, scorer = _made(json.dumps(recipe, sort_keys=True), item["index"], item["entry"]["question"])
    return float(scorer(answer, entry))


@register_reward("reasoning_gym")
def reasoning_gym_reward(completions: list[str], gym: list[dict | None] | None = None, **_: object) -> list:
    """Each completion's score by its task's own scorer (0..1; some tasks give partial credit); None for
    a row that is not a reasoning-gym item."""
    items = gym if gym is not None else [None] * len(completions)
    return [None if item is None else score_item(text, item) for text, item in zip(completions, items)]
