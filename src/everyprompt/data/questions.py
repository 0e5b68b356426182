"""Built-in task for pretrained chat models: arithmetic questions in English, answered in the model's own
words and judged on the final answer it states (rewards/math.py).

A chat model is asked "What is 7 × 8?", not shown `7*8=`: bare expressions are not how anyone talks to it,
and an instruct model answers them worse. The levels are ordered by how hard they are for
SmolLM2-135M-Instruct (the per-level pass rates are in docs/models.md). The worked solutions, for an SFT
warm start if one is wanted, state the arithmetic and then "The answer is N."
"""

from __future__ import annotations

import random

from everyprompt.data.tasks import Level, Task, register_task
from everyprompt.data.wordproblems import NAMES, THINGS, word_problem

WORD_OPERANDS = range(2, 31)  # word_problem's a and b


def _times_table(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    return f"What is {a} × {b}?", str(a * b), f"{a} × {b} = {a * b}. The answer is {a * b}."


def _sum(low: int, high: int):
    def draw(rng: random.Random) -> tuple[str, str, str]:
        a, b = rng.randint(low, high), rng.randint(low, high)
        return f"What is {a} + {b}?", str(a + b), f"{a} + {b} = {a + b}. The answer is {a + b}."

    return draw


def _product(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(13, 99), rng.randint(13, 99)
    return f"What is {a} × {b}?", str(a * b), f"{a} × {b} = {a * b}. The answer is {a * b}."


def _word(rng: random.Random) -> tuple[str, str, str]:
    problem = word_problem(rng)
    steps, answer = problem["answer"].split("\n#### ")
    worked = steps.split(" = <<")[0] + " = " + answer + steps.split(">>" + answer, 1)[-1]
    return problem["question"], answer, f"{worked}\nThe answer is {answer}."


def _word_problems() -> int:
    """Distinct word problems: per name and thing, `more` takes any (a, b), `less` an unordered pair,
    `times` (a % 9 + 2, b % 9 + 2) one of 9 x 9."""
    n = len(WORD_OPERANDS)
    return len(NAMES) * len(THINGS) * (n * n + n * (n + 1) // 2 + 9 * 9)


QUESTIONS = register_task(
    Task(
        "questions",
        "arithmetic questions and word problems in English (`What is 7 × 8?`): for pretrained chat models",
        {
            1: Level("times tables, 2..12 × 2..12", 11 * 11, _times_table),
            2: Level("sums of two one-digit numbers", 10 * 10, _sum(0, 9)),
            3: Level("sums of two numbers of 1-2 digits", 100 * 100, _sum(0, 99)),
            4: Level("word problems (one +, -, or × step)", _word_problems(), _word),
            5: Level("sums of two 3-digit numbers", 900 * 900, _sum(100, 999)),
            # beyond a small model's head: the calculator environment's task (docs/environments.md)
            6: Level("products of two 2-digit numbers (13..99)", 87 * 87, _product),
        },
    )
)
