"""The built-in `questions` task: questions in English, exact distinct counts, its levels in the config."""

import random

import pytest

from everyprompt import choices
from everyprompt.data import TASKS, get_task, make_splits
from everyprompt.data.tasks import largest_num_train, oversubscribed
from everyprompt.rewards.math import math_reward


def test_the_registered_tasks_are_the_ones_the_config_accepts():
    assert set(TASKS) == set(choices.TASKS)


@pytest.mark.parametrize("level", [1, 2, 3, 4, 5, 6])
def test_each_level_asks_a_question_whose_worked_solution_earns_the_reward(level):
    task, rng = get_task("questions"), random.Random(level)
    for _ in range(50):
        problem = task.problem(rng, level)
        assert problem.level == level and problem.prompt.endswith("?")
        assert "=" not in problem.prompt  # a question, not a bare expression
        assert math_reward([problem.solution], answer=[problem.answer]) == [1.0], problem


def test_a_times_table_question_and_its_answer():
    problem = get_task("questions").problem(random.Random(0), 1)
    a, b = (int(x) for x in problem.prompt.removeprefix("What is ").removesuffix("?").split(" × "))
    assert 2 <= a <= 12 and 2 <= b <= 12 and problem.answer == str(a * b)


@pytest.mark.parametrize("level, count", [(1, 121), (2, 100)])
def test_small_levels_hold_exactly_their_distinct_count(level, count):
    task, rng = get_task("questions"), random.Random(3)
    seen = {task.problem(rng, level).prompt for _ in range(20 * count)}
    assert len(seen) == task.distinct(level) == count


def test_word_problems_count_every_prompt_the_generator_can_write():
    # 8 names x 8 things x (29 * 29 `more` + 435 `less` pairs + 81 `times`) = 86,848
    assert get_task("questions").distinct(4) == 86_848


def test_splits_of_a_small_level_are_disjoint_and_refused_past_its_size():
    task = get_task("questions")
    train, held_out = make_splits(0, 71, 50, [1], "questions")
    assert len({p.prompt for p in train + held_out}) == 121  # every times-table question, none twice
    assert oversubscribed(task, 72, 50, [1]) == [(1, 122, 121)]
    assert largest_num_train(task, 50, [1]) == 71


def test_unknown_task_or_level_exits_2_naming_the_key(tmp_path, capsys):
    from everyprompt.cli import main

    assert main(["train", "data.task=poetry", "--run-dir", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "data.task" in err and "arithmetic, questions" in err and "Traceback" not in err
    assert main(["train", "data.task=questions", "data.levels=[1,7]", "--run-dir", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "config key 'data.levels'" in err and "no level 7" in err and "Traceback" not in err
    assert main(["train", "data.task=questions", "data.levels=[2]", "--run-dir", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "level 2 of the built-in task 'questions' has 100 distinct problems" in err
