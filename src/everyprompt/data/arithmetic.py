"""Built-in verifiable task: multi-operand addition with worked, column-by-column solutions.

A problem is a bare expression (``37+48=``); its worked solution adds one digit column at a time from
the right, carrying as it goes (``7+8+0=15;3+4+1=8|85``), and ends with the answer after ``|``. Levels
1..5 add digits and operands. A tiny model cannot learn bare answers, but it can learn the worked form,
which gives RL a verifiable reward with room to improve.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# level -> (operands, min digits, max digits): 1 = two 1-2 digit numbers, 2 = two 2-digit, 3 = two 3-digit,
# 4 = three 3-digit, 5 = four 3-digit. After the demo's SFT, levels 1-3 are mostly solved and 4-5 are not:
# their column sums reach 20-39 and carries of 2-3, where the warm-started model is still off by one.
LEVELS: dict[int, tuple[int, int, int]] = {
    1: (2, 1, 2),
    2: (2, 2, 2),
    3: (2, 3, 3),
    4: (3, 3, 3),
    5: (4, 3, 3),
}


@dataclass(frozen=True)
class Problem:
    prompt: str  # "37+48="
    answer: str  # "85"
    level: int
    solution: str  # worked completion, "7+8+0=15;3+4+1=8|85"

    def as_row(self) -> dict:
        return {"prompt": self.prompt, "answer": self.answer, "level": self.level, "solution": self.solution}


def worked_solution(operands: list[int]) -> str:
    """Column-by-column addition, least significant digit first, with the carry written out."""
    digits = [str(x)[::-1] for x in operands]
    width = max(len(d) for d in digits)
    steps, carry = [], 0
    for col in range(width):
        column = [int(d[col]) for d in digits if col < len(d)]
        total = sum(column) + carry
        steps.append("+".join(str(x) for x in column) + f"+{carry}={total}")
        carry = total // 10
    return ";".join(steps) + f"|{sum(operands)}"


def random_problem(rng: random.Random, level: int) -> Problem:
    if level not in LEVELS:
        raise ValueError(f"difficulty level {level} is not one of {sorted(LEVELS)}")
    count, low, high = LEVELS[level]
    operands = []
    for _ in range(count):
        n_digits = rng.randint(low, high)
        operands.append(rng.randint(10 ** (n_digits - 1) if n_digits > 1 else 0, 10**n_digits - 1))
    prompt = "+".join(str(x) for x in operands) + "="
    return Problem(prompt, str(sum(operands)), level, worked_solution(operands))


def distinct_problems(level: int) -> int:
    """How many different prompts `level` has (each operand's values, to the power of the operands)."""
    count, low, high = LEVELS[level]
    return (10**high - (10 ** (low - 1) if low > 1 else 0)) ** count


def _share(total: int, position: int, levels: int) -> int:
    """How many of `total` problems dealt to `levels` levels in turn land on the level at `position`."""
    return max(0, -(-(total - position) // levels))


def oversubscribed(num_train: int, num_eval: int, levels) -> list[tuple[int, int, int]]:
    """(level, problems asked of it, distinct problems it has) for each level `make_splits` would ask for
    more distinct problems than it holds (the splits deal problems to the levels in turn)."""
    levels = list(levels)
    asked = [
        (level, _share(num_eval, j, len(levels)) + _share(num_train, j, len(levels)))
        for j, level in enumerate(levels)
    ]
    return [(level, n, distinct_problems(level)) for level, n in asked if n > distinct_problems(level)]


def largest_num_train(num_eval: int, levels) -> int:
    """The largest `num_train` no level is short of beside `num_eval` held-out problems (-1: none is, the
    held-out split alone asks too much). The level at position j gets ceil((n - j) / L) of n, so n may
    reach L * (its room after the held-out share) + j."""
    levels = list(levels)
    room = [distinct_problems(level) - _share(num_eval, j, len(levels)) for j, level in enumerate(levels)]
    return -1 if min(room) < 0 else min(len(levels) * r + j for j, r in enumerate(room))


def make_splits(
    seed: int, num_train: int, num_eval: int, levels: list[int] | tuple[int, ...] = tuple(LEVELS)
) -> tuple[list[Problem], list[Problem]]:
    """Disjoint train / held-out problem lists, balanced over `levels`, reproducible from `seed`.

    The held-out split is drawn first, so it does not change when `num_train` changes.
    """
    rng = random.Random(seed)
    seen: set[str] = set()

    def draw(count: int) -> list[Problem]:
        problems: list[Problem] = []
        attempts = 0
        while len(problems) < count:
            level = levels[len(problems) % len(levels)]
            problem = random_problem(rng, level)
            attempts += 1
            if problem.prompt in seen:
                if attempts > 50 * count + 1000:
                    raise ValueError(f"cannot draw {count} distinct problems from levels {list(levels)}")
                continue
            seen.add(problem.prompt)
            problems.append(problem)
        return problems

    held_out = draw(num_eval)
    train = draw(num_train)
    return train, held_out
