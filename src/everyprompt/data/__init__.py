"""Prompt data: the built-in verifiable task, JSONL/Parquet prompt files and the prompt cursor."""

from everyprompt.data.arithmetic import LEVELS, Problem, make_splits, worked_solution
from everyprompt.data.datasets import DataError, PromptCursor, load_prompt_file

__all__ = [
    "LEVELS",
    "DataError",
    "Problem",
    "PromptCursor",
    "load_prompt_file",
    "make_splits",
    "worked_solution",
]
