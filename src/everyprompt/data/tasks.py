"""Built-in verifiable tasks and their train / held-out splits.

A task is a set of difficulty levels, each a generator of problems (a prompt, its answer and a worked
solution for SFT) with a known number of distinct prompts. `make_splits` deals problems to the levels in
turn, held-out first, never repeating a prompt; `oversubscribed` and `largest_num_train` say in closed form
when a split asks a level for more distinct problems than it has, so that a config can be refused before
any drawing starts.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from everyprompt.data.datasets import DataError


@dataclass(frozen=True)
class Problem:
    prompt: str  # "37+48=" or "What is 37 + 48?"
    answer: str  # "85"
    level: int
    solution: str  # a worked completion that ends with the answer

    def as_row(self) -> dict:
        return {"prompt": self.prompt, "answer": self.answer, "level": self.level, "solution": self.solution}


@dataclass(frozen=True)
class Level:
    """One difficulty level: what it asks, how many distinct prompts it has, and its generator."""

    description: str
    distinct: int
    draw: Callable[[random.Random], tuple[str, str, str]]  # rng -> (prompt, answer, solution)


@dataclass(frozen=True)
class Task:
    name: str
    summary: str
    levels: dict[int, Level]

    def problem(self, rng: random.Random, level: int) -> Problem:
        if level not in self.levels:
            raise DataError(
                f"task {self.name!r} has no difficulty level {level}; its levels: {sorted(self.levels)}"
            )
        prompt, answer, solution = self.levels[level].draw(rng)
        return Problem(prompt, answer, level, solution)

    def distinct(self, level: int) -> int:
        return self.levels[level].distinct


TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    TASKS[task.name] = task
    return task


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise DataError(f"unknown built-in task {name!r}; tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def _share(total: int, position: int, levels: int) -> int:
    """How many of `total` problems dealt to `levels` levels in turn land on the level at `position`."""
    return max(0, -(-(total - position) // levels))


def oversubscribed(
    task: Task, num_train: int, num_eval: int, levels: Iterable[int]
) -> list[tuple[int, int, int]]:
    """(level, problems asked of it, distinct problems it has) for each level `make_splits` would ask for
    more distinct problems than it holds (the splits deal problems to the levels in turn)."""
    levels = list(levels)
    asked = [
        (level, _share(num_eval, j, len(levels)) + _share(num_train, j, len(levels)))
        for j, level in enumerate(levels)
    ]
    return [(level, n, task.distinct(level)) for level, n in asked if n > task.distinct(level)]


def largest_num_train(task: Task, num_eval: int, levels: Iterable[int]) -> int:
    """The largest `num_train` no level is short of beside `num_eval` held-out problems (-1: none is, the
    held-out split alone asks too much). The level at position j gets ceil((n - j) / L) of n, so n may
    reach L * (its room after the held-out share) + j."""
    levels = list(levels)
    room = [task.distinct(level) - _share(num_eval, j, len(levels)) for j, level in enumerate(levels)]
    return -1 if min(room) < 0 else min(len(levels) * r + j for j, r in enumerate(room))


def make_splits(
    seed: int,
    num_train: int,
    num_eval: int,
    levels: Iterable[int] | None = None,
    task: str | Task = "arithmetic",
) -> tuple[list[Problem], list[Problem]]:
    """Disjoint train / held-out problem lists, balanced over `levels` (default: all of the task's),
    reproducible from `seed`. The held-out split is drawn first, so it does not change when `num_train`
    changes."""
    task = get_task(task) if isinstance(task, str) else task
    levels = list(task.levels if levels is None else levels)
    rng = random.Random(seed)
    seen: set[str] = set()

    def draw(count: int) -> list[Problem]:
        problems: list[Problem] = []
        attempts = 0
        while len(problems) < count:
            level = levels[len(problems) % len(levels)]
            problem = task.problem(rng, level)
            attempts += 1
            if problem.prompt in seen:
                if (
                    attempts > 50 * count + 1000
                ):  # the level's draws are uneven and its rare prompts are all taken
                    raise DataError(
                        f"task {task.name!r}: could not draw {count} distinct problems from levels {levels} "
                        f"in {attempts} tries; ask fewer (data.num_train, data.num_eval)"
                    )
                continue
            seen.add(problem.prompt)
            problems.append(problem)
        return problems

    held_out = draw(num_eval)
    train = draw(num_train)
    return train, held_out
