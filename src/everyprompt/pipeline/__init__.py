"""The pipelines a command runs, composed from the library: a run's stages (`run.py`), the choice of
backend for the loop's two sides (`backends.py`), and `train`, `demo`, `warm_start`,
`evaluate_checkpoint`, `filter_prompts` (`commands.py`)."""

from everyprompt.pipeline.backends import BACKENDS, build_trainer
from everyprompt.pipeline.commands import demo, evaluate_checkpoint, filter_prompts, train, warm_start
from everyprompt.pipeline.run import Run

__all__ = [
    "BACKENDS",
    "Run",
    "build_trainer",
    "demo",
    "evaluate_checkpoint",
    "filter_prompts",
    "train",
    "warm_start",
]
