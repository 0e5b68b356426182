"""The prompt rows a config names: RL prompts, SFT worked solutions and held-out prompts, from its data
files or from the built-in task's train / held-out split (made once, by `data.split_seed`)."""

from __future__ import annotations

from everyprompt.choices import GYM
from everyprompt.config import Config, ConfigError
from everyprompt.data.datasets import load_prompt_file
from everyprompt.data.gym import GymRows
from everyprompt.data.tasks import get_task, largest_num_train, make_splits, oversubscribed


class ConfigRows:
    """`rl()`, `sft()` and `held_out()` rows of `config`."""

    def __init__(self, config: Config):
        self.config = config
        self._splits = None
        self.gym = GymRows(config) if config.data.task == GYM else None  # its names checked here

    def _builtin(self):
        if self._splits is None:
            data = self.config.data
            task = get_task(data.task)
            for key, levels in (
                ("data.levels", data.levels),
                ("rl.levels", self.config.rl.levels or []),
                ("sft.levels", self.config.sft.levels if self.config.sft.steps else []),
            ):
                unknown = [level for level in levels if level not in task.levels]
                if unknown:
                    raise ConfigError(
                        f"config key '{key}': the built-in task {task.name!r} has no level {unknown[0]}; its "
                        f"levels are {sorted(task.levels)}"
                    )
            short = oversubscribed(task, data.num_train, data.num_eval, data.levels)
            if short:
                level, asked, held = short[0]
                largest = largest_num_train(task, data.num_eval, data.levels)
                key, fix = (
                    ("data.num_train", f"lower data.num_train (at most {largest}) or add levels")
                    if largest >= 0
                    else ("data.num_eval", "lower data.num_eval or add levels")
                )
                raise ConfigError(
                    f"config key '{key}': level {level} of the built-in task {task.name!r} has {held} distinct problems, and "
                    f"data.num_train={data.num_train} + data.num_eval={data.num_eval} over "
                    f"data.levels={data.levels} ask {asked} of it; {fix}"
                )
            self._splits = make_splits(data.split_seed, data.num_train, data.num_eval, data.levels, task)
        return self._splits

    def _required(self) -> tuple[str, ...]:
        """The fields every prompt row needs: an `answer` for the rewards, unless an environment judges
        the episodes (config `env`; it checks the rows it needs when the run starts)."""
        return () if self.config.env.name else ("answer",)

    def rl(self) -> list[dict]:
        """The RL prompts: `data.train_file`, else the built-in train split at `rl.levels` (or data's)."""
        data = self.config.data
        if data.train_file:
            return load_prompt_file(data.train_file, data.columns, self._required(), "data.train_file")
        if self.gym is not None:
            return self.gym.train()
        levels = set(self.config.rl.levels or data.levels)
        return [p.as_row() for p in self._builtin()[0] if p.level in levels]

    def sft(self) -> list[dict]:
        """The worked solutions SFT trains on; a train file without them is a config error (sft.steps)."""
        data = self.config.data
        if self.gym is not None:
            raise ConfigError(
                f"config key 'sft.steps': SFT ({self.config.sft.steps} steps) trains on worked solutions, which "
                f"data.task={GYM} does not have; set sft.steps=0"
            )
        if not data.train_file:
            levels = set(self.config.sft.levels)
            return [p.as_row() for p in self._builtin()[0] if p.level in levels]
        rows = load_prompt_file(data.train_file, data.columns, (), "data.train_file")
        lacking = [i for i, row in enumerate(rows) if not row.get("solution")]
        if lacking:
            column = data.columns.get("solution", "solution")
            raise ConfigError(
                f"config key 'sft.steps': SFT ({self.config.sft.steps} steps) needs a worked solution per "
                f"row, and row {lacking[0] + 1} of {data.train_file} has no {column!r} (map the column "
                "with data.columns.solution=COLUMN, or set sft.steps=0)"
            )
        return rows

    def held_out(self) -> list[dict]:
        """The held-out prompts: `data.eval_file`, else the built-in held-out split."""
        data = self.config.data
        if data.eval_file:
            return load_prompt_file(data.eval_file, data.columns, self._required(), "data.eval_file")
        if self.gym is not None:
            return self.gym.held_out()
        return [p.as_row() for p in self._builtin()[1]]
