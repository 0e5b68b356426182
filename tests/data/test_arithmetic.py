import random
import re

import pytest

from everyprompt.data import LEVELS, make_splits, worked_solution
from everyprompt.data.arithmetic import random_problem
from everyprompt.rewards import math_reward


def test_worked_solution_by_hand():
    # 7+8+carry 0 = 15 -> write 5 carry 1; 3+4+1 = 8 -> 85
    assert worked_solution([37, 48]) == "7+8+0=15;3+4+1=8|85"
    # 57+48: 7+8=15, 5+4+1=10 -> the final carry lands in the answer, 105
    assert worked_solution([57, 48]) == "7+8+0=15;5+4+1=10|105"
    # three operands of different length: 5+9+1=15; 2+1 (carry) = 3; 1 -> 135? 125+9+1 = 135
    assert worked_solution([125, 9, 1]) == "5+9+1+0=15;2+1=3;1+0=1|135"


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_problems_are_consistent(level):
    rng = random.Random(level)
    for _ in range(50):
        problem = random_problem(rng, level)
        operands = [int(x) for x in problem.prompt.rstrip("=").split("+")]
        assert len(operands) == LEVELS[level][0]
        assert int(problem.answer) == sum(operands)
        assert problem.solution.endswith("|" + problem.answer)
        assert math_reward([problem.solution], answer=[problem.answer]) == [1.0]
        assert re.fullmatch(r"[0-9+=;|]+", problem.solution)


def test_splits_are_disjoint_balanced_and_reproducible():
    train, held_out = make_splits(7, 200, 50)
    again_train, again_held = make_splits(7, 300, 50)
    assert [p.prompt for p in held_out] == [p.prompt for p in again_held]  # held-out independent of num_train
    assert [p.prompt for p in train] == [p.prompt for p in again_train[:200]]
    assert not {p.prompt for p in train} & {p.prompt for p in held_out}
    assert sorted({p.level for p in held_out}) == [1, 2, 3, 4, 5]
    assert [p.level for p in held_out].count(1) == 10
    assert make_splits(8, 10, 10)[1] != held_out[:10]


def test_unknown_level_is_an_error():
    with pytest.raises(ValueError, match="level 9"):
        random_problem(random.Random(0), 9)


def test_each_level_holds_a_known_number_of_distinct_problems():
    from everyprompt.data.arithmetic import ARITHMETIC as task
    from everyprompt.data.arithmetic import distinct_problems
    from everyprompt.data.tasks import largest_num_train, oversubscribed

    # level 1: two operands of 0..99 -> 100 * 100; level 2: two of 10..99 -> 90 * 90; level 4: 900^3
    assert [distinct_problems(level) for level in (1, 2, 4)] == [10_000, 8_100, 900**3]
    # 9,500 + 500 on level 1 alone is exactly its 10,000; one more is too many
    assert oversubscribed(task, 9_500, 500, [1]) == []
    assert oversubscribed(task, 9_501, 500, [1]) == [(1, 10_001, 10_000)]
    # dealt in turn over [1, 2]: 20,000 + 500 -> 10,250 each; both levels are short
    assert oversubscribed(task, 20_000, 500, [1, 2]) == [(1, 10_250, 10_000), (2, 10_250, 8_100)]
    # [1, 2] beside 500 held-out: level 2 (position 1) has 8,100 - 250 = 7,850 left for floor(n / 2) -> 15,701
    assert largest_num_train(task, 500, [1, 2]) == 15_701
    assert oversubscribed(task, 15_701, 500, [1, 2]) == [] and oversubscribed(task, 15_702, 500, [1, 2]) != []
    assert largest_num_train(task, 10_001, [1]) == -1  # the held-out split alone is too much for level 1


def test_levels_that_cannot_give_the_problems_asked_exit_2_naming_the_key_and_the_limit(tmp_path, capsys):
    from everyprompt.cli import main

    assert main(["train", "data.levels=[1,2]", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert (
        "config key 'data.num_train'" in err[0]
        and "level 1 of the built-in task 'arithmetic' has 10000 distinct problems" in err[0]
    )
    # level 2 (8,100) gets 250 held-out problems and floor(n / 2) of n training ones: n <= 2 * 7,850 + 1
    assert "ask 10250 of it" in err[0] and "at most 15701" in err[0]
    assert main(["train", "data.levels=[1]", "data.num_eval=10001", "--run-dir", str(tmp_path / "r2")]) == 2
    assert "config key 'data.num_eval'" in capsys.readouterr().err  # the held-out split alone is too much
