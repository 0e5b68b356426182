"""Which prompts a step draws from reasoning-gym's tasks: the tasks' mix, and with `curriculum.levels`
each task's level, moved by its own recent pass rate (docs/data.md).

The staged curriculum of Compass-Thinker-7B (arXiv 2508.08909) raises difficulty in stages the user
writes down; a procedural task carries its difficulty ladder with it (reasoning-gym's curricula), so here
each task climbs its own: after `window` groups of a task at its current level, a mean pass rate at or
above `promote` moves it up one level (up to `top`), at or below `demote` down one (never below `start`),
and the window starts again. A task whose groups are mostly solved is the signal ZVE's retirement reads
too: such groups carry no gradient under group-relative advantages, so the task moves on before its
prompts run out. The levels and windows are part of the rollout side's state: `--resume` restores them.
"""

from __future__ import annotations

from collections import deque

from everyprompt.config import TaskLevelsConfig
from everyprompt.data.gym import bucket


class TaskMix:
    """The tasks' weights, each task at one level (no curriculum): a fixed mixture over their buckets."""

    def __init__(self, weights: dict[str, float], levels: dict[str, int | None]):
        self.weights, self.level = dict(weights), dict(levels)

    def mixture(self) -> dict[str, float]:
        return {bucket(task, self.level[task]): weight for task, weight in self.weights.items()}

    def observe(self, results: list[tuple[str, int | None, float]]) -> dict[str, float]:
        """This step's groups, (task, level, pass rate) each: the step's metrics per task."""
        stats: dict[str, float] = {}
        for task in self.weights:
            rates = [rate for name, _, rate in results if name == task]
            if rates:
                stats[f"tasks/{task}/pass_rate"] = sum(rates) / len(rates)
        return stats

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class TaskLevels(TaskMix):
    """Each task's level moved by the pass rate of its recent groups at that level."""

    def __init__(self, weights: dict[str, float], ladders: dict[str, list[int]], config: TaskLevelsConfig):
        super().__init__(weights, {task: ladder[0] for task, ladder in ladders.items()})
        self.ladders, self.config = ladders, config
        self.recent = {task: deque(maxlen=config.window) for task in weights}
        self.moves = 0

    def observe(self, results: list[tuple[str, int | None, float]]) -> dict[str, float]:
        """Record this step's groups; move the tasks whose window is full and past a threshold. The
        metrics: each task's pass rate and level this step, and the moves so far."""
        stats = super().observe(results)
        for task, level in self.level.items():  # the level this step drew from
            stats[f"curriculum/level/{task}"] = float(level)
        for task, level, rate in results:
            if level == self.level[task]:  # a group drawn before its task moved says nothing of the new level
                self.recent[task].append(rate)
        for task, recent in self.recent.items():
            if len(recent) < self.config.window:
                continue
            mean, ladder, level = sum(recent) / len(recent), self.ladders[task], self.level[task]
            position = ladder.index(level)
            if mean >= self.config.promote and position + 1 < len(ladder):
                self.level[task] = ladder[position + 1]
            elif mean <= self.config.demote and position > 0:
                self.level[task] = ladder[position - 1]
            if self.level[task] != level:
                self.moves += 1
                recent.clear()
        stats["curriculum/level_moves"] = float(self.moves)
        return stats

    def state_dict(self) -> dict:
        return {
            "level": dict(self.level),
            "recent": {task: list(recent) for task, recent in self.recent.items()},
            "moves": self.moves,
        }

    def load_state_dict(self, state: dict) -> None:
        unknown = sorted(set(state["level"]) ^ set(self.level))
        if unknown:
            raise ValueError(
                f"the checkpoint's task levels are of tasks {sorted(state['level'])}; the config's are "
                f"{sorted(self.level)}"
            )
        for task, level in state["level"].items():
            if level not in self.ladders[task]:
                raise ValueError(
                    f"the checkpoint has task {task} at level {level}; the config's levels for it are "
                    f"{self.ladders[task]}"
                )
        self.level = dict(state["level"])
        self.recent = {
            task: deque(values, maxlen=self.config.window) for task, values in state["recent"].items()
        }
        self.moves = state["moves"]
