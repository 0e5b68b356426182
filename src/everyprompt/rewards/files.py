"""`everyprompt score`: score the completions of a JSONL file with a reward function, row by row."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from everyprompt.data.datasets import read_jsonl
from everyprompt.rewards.base import (
    RewardFailure,
    get_reward,
    reward_columns,
    score_completions,
    summarize_failures,
)


@dataclass
class Scored:
    rows: int
    mean: float  # over the rows that could be scored (NaN when none could)
    failures: dict[str, tuple[int, RewardFailure]]  # summary -> (count, first failure)


def score_file(
    path: str | Path,
    reward: str,
    completion_field: str = "completion",
    answer_field: str = "answer",
    output: str | Path | None = None,
) -> Scored:
    """Each row of `path` with its `reward` (a registered name or `package.module:function`) added, written
    to `output` as JSONL (stdout when None); the row's other columns are the reward's keyword columns."""
    rows = read_jsonl(path, required=(completion_field, answer_field))
    fn = get_reward(reward)
    columns = reward_columns(rows)
    columns["answer"] = [str(row[answer_field]) for row in rows]
    columns.pop(completion_field, None)
    completions = [str(row[completion_field]) for row in rows]
    rewards, failures = score_completions(fn, completions, columns)
    out = open(output, "w", encoding="utf-8") if output else sys.stdout
    try:
        for row, value in zip(rows, rewards):
            out.write(json.dumps({**row, "reward": value}) + "\n")
    finally:
        if output:
            out.close()
    scored = [r for r in rewards if r is not None]
    mean = sum(scored) / len(scored) if scored else float("nan")
    return Scored(len(rows), mean, summarize_failures(failures))
