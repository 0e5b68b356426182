"""What each step draws: the prompt source over difficulty buckets, and what weighs the buckets: the staged
curriculum (`curriculum.stages`), reasoning-gym's task mix and levels (`data.task=reasoning-gym`,
`curriculum.levels`), or nothing (every prompt alike)."""

from __future__ import annotations

from collections.abc import Callable

from everyprompt.choices import GYM
from everyprompt.config import Config
from everyprompt.data.curriculum import Curriculum
from everyprompt.data.gym import buckets as task_buckets
from everyprompt.data.levels import TaskLevels, TaskMix
from everyprompt.data.source import ALL, PromptSource, buckets_by_field, buckets_by_pass_rate


def task_plan(config: Config, prompts: list[dict]) -> TaskMix | None:
    """The tasks' mix (and levels, with curriculum.levels) of reasoning-gym rows; None for other data."""
    if config.data.task != GYM:  # (the config refuses data.train_file beside it)
        return None
    weights = {name: task.weight for name, task in config.data.reasoning_gym.tasks.items()}
    ladders: dict[str, set] = {name: set() for name in weights}
    for row in prompts:
        ladders[row["task"]].add(row["level"])
    if config.curriculum.levels.enabled:
        return TaskLevels(
            weights, {t: sorted(levels) for t, levels in ladders.items()}, config.curriculum.levels
        )
    return TaskMix(weights, {task: next(iter(levels)) for task, levels in ladders.items()})


class PromptPlan:
    """The prompt source and the curriculum or task mix that weighs its buckets; its state is checkpointed."""

    def __init__(self, config: Config, prompts: list[dict], pass_rate: Callable[[str], float | None]):
        self.config, self.prompts, self.pass_rate = config, prompts, pass_rate
        self.curriculum = Curriculum(config.curriculum) if config.curriculum.stages else None
        self.tasks = task_plan(config, prompts)
        self.source = PromptSource(self._buckets(), config.seed)

    def _buckets(self) -> dict[str, list[int]]:
        """Prompt buckets of the current curriculum stage, of the tasks' levels, or one bucket."""
        if self.tasks is not None:
            return task_buckets(self.prompts)
        if self.curriculum is None:
            return {ALL: list(range(len(self.prompts)))}
        if self.config.curriculum.difficulty == "field":
            return buckets_by_field(self.prompts, self.config.curriculum.field)
        return buckets_by_pass_rate(self.prompts, self.pass_rate, self.config.curriculum.pass_rate_edges)

    def mixture(self) -> dict[str, float] | None:
        if self.tasks is not None:
            return self.tasks.mixture()
        return self.curriculum.stage.mixture if self.curriculum is not None else None

    def take(self, count: int, available: Callable[[int], bool] | None) -> list[int]:
        return self.source.take(count, self.mixture(), available)

    def overrides(self) -> dict:
        """The current stage's settings (rollout.temperature, ..., max_new_tokens) over the config's."""
        if self.curriculum is None:
            return {}
        stage = self.curriculum.stage
        return {
            **stage.overrides,
            **({"max_new_tokens": stage.max_new_tokens} if stage.max_new_tokens else {}),
        }

    def observe(self, step: int, accuracy: float, groups: list[tuple[int, float]]) -> dict[str, float]:
        """After step `step` (0-based): its training accuracy and its groups' (prompt index, pass rate);
        the stage or the tasks' levels move; the step's curriculum metrics."""
        stats: dict[str, float] = {}
        if self.tasks is not None:
            rows = self.prompts
            stats.update(
                self.tasks.observe([(rows[i]["task"], rows[i]["level"], rate) for i, rate in groups])
            )
        if self.curriculum is not None:
            stats["curriculum/stage"] = float(self.curriculum.index + 1)  # the stage this step ran in
            if self.curriculum.observe(step + 1, accuracy):
                self.source.set_buckets(self._buckets())
        return stats

    def state_dict(self) -> dict:
        return {
            "source": self.source.state_dict(),
            "curriculum": self.curriculum.state_dict() if self.curriculum else None,
            "tasks": self.tasks.state_dict() if self.tasks else None,
        }

    def load_state_dict(self, state: dict) -> None:
        if self.curriculum is not None and state["curriculum"] is not None:
            self.curriculum.load_state_dict(state["curriculum"])
        if self.tasks is not None and state.get("tasks") is not None:
            self.tasks.load_state_dict(state["tasks"])
        self.source.load_state_dict(state["source"])
