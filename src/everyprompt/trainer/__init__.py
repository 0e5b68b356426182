"""Training: the rollout side, the learner side, the RL loop that composes them, SFT, checkpoints, metrics."""

from everyprompt.trainer.checkpoint import CheckpointError, save_checkpoint
from everyprompt.trainer.learner_side.learner import Learner
from everyprompt.trainer.loop import RLTrainer, StepHook
from everyprompt.trainer.rollout_side import LocalRolloutSide
from everyprompt.trainer.sft import run_sft

__all__ = [
    "CheckpointError",
    "Learner",
    "RLTrainer",
    "LocalRolloutSide",
    "StepHook",
    "run_sft",
    "save_checkpoint",
]
