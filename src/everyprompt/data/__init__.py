"""Prompt data: the built-in verifiable tasks, JSONL/Parquet prompt files and the prompt cursor."""

from everyprompt.data import arithmetic, questions  # noqa: F401  (the built-in tasks register themselves)
from everyprompt.data.arithmetic import LEVELS, worked_solution
from everyprompt.data.datasets import DataError, PromptCursor, load_prompt_file
from everyprompt.data.tasks import TASKS, Problem, Task, get_task, make_splits

__all__ = [
    "LEVELS",
    "TASKS",
    "DataError",
    "Problem",
    "PromptCursor",
    "Task",
    "get_task",
    "load_prompt_file",
    "make_splits",
    "worked_solution",
]
