"""Built-in verifiable task: multi-operand addition with worked, column-by-column solutions.

A problem is a bare expression (``37+48=``); its worked solution adds one digit column at a time from
the right, carrying as it goes (``7+8+0=15;3+4+1=8|85``), and ends with the answer after ``|``. Levels
1..5 add digits and operands. A tiny model cannot learn bare answers, but it can learn the worked form,
which gives RL a verifiable reward with room to improve.
"""

from __future__ import annotations

import random

from everyprompt.data.tasks import Level, Problem, Task, register_task

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


def _level(level: int) -> Level:
    count, low, high = LEVELS[level]
    digits = f"{low}-{high}" if low != high else f"{low}"

    def draw(rng: random.Random) -> tuple[str, str, str]:
        problem = random_problem(rng, level)
        return problem.prompt, problem.answer, problem.solution

    return Level(f"{count} numbers of {digits} digits, summed", distinct_problems(level), draw)


ARITHMETIC = register_task(
    Task(
        "arithmetic",
        "bare sums (`37+48=`) with column-by-column worked solutions: for models trained from scratch",
        {level: _level(level) for level in LEVELS},
    )
)
