"""Training: the RL loop, the SFT warm start, checkpoints and metrics."""

from everyprompt.trainer.batch import RolloutBatch
from everyprompt.trainer.checkpoint import CheckpointError, resolve_checkpoint, save_checkpoint
from everyprompt.trainer.rl import RLTrainer
from everyprompt.trainer.sft import run_sft

__all__ = ["CheckpointError", "RLTrainer", "RolloutBatch", "resolve_checkpoint", "run_sft", "save_checkpoint"]
