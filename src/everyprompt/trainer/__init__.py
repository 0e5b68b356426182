"""Training: the rollout side, the learner side, the RL loop that composes them, SFT, checkpoints, metrics."""

from everyprompt.trainer.batch import RolloutBatch
from everyprompt.trainer.checkpoint import CheckpointError, resolve_checkpoint, save_checkpoint
from everyprompt.trainer.learner import Learner
from everyprompt.trainer.loop import RLTrainer
from everyprompt.trainer.rollout_side import RolloutSide
from everyprompt.trainer.sft import run_sft

__all__ = [
    "CheckpointError",
    "Learner",
    "RLTrainer",
    "RolloutBatch",
    "RolloutSide",
    "resolve_checkpoint",
    "run_sft",
    "save_checkpoint",
]
