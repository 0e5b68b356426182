"""What a run checks before any work, so that a setting that cannot work fails in seconds with its key
named, not after SFT or hours of RL: the held-out reward resolves, the environment answers, the teachers
fit the student."""

from __future__ import annotations

from everyprompt.config import Config
from everyprompt.envs.episode import probe_environment
from everyprompt.evaluate import held_out_rewards
from everyprompt.models.io import config_tokenizer
from everyprompt.rewards import build_reward
from everyprompt.trainer.learner_side.distill import check_teachers, student_name


def check_before_work(config: Config, rows: list[dict]) -> None:
    """Each check the config calls for; `rows`: the RL prompts (a teacher's column is looked up in them)."""
    if config.eval.reward is not None:  # one that does not resolve fails now, not after RL
        build_reward(held_out_rewards(config))
    if config.env.name is not None:  # an unknown name, a bad option, a server that does not answer
        probe_environment(config.env.name, config.env.options)
    if config.rl.teacher.enabled:  # a teacher that does not fit fails now, before SFT
        student = config_tokenizer(config.model)
        check_teachers(config.rl.teacher, student, student_name(config), rows)
