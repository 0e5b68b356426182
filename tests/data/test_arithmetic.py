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
