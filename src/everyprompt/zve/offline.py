"""ZVE stage 0, the offline filter (docs/zve.md): estimate each prompt's pass rate with k samples of the
starting policy, keep the prompts neither always solved nor never, and record the rates in the pass-rate
store (`everyprompt filter`, or before RL with `zve.filter.enabled`; `zve/workflow.py` runs it with a
config's engine and reward).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from everyprompt.data.formatting import PlainFormat
from everyprompt.generation import sample_and_score
from everyprompt.rewards.pool import RewardPool
from everyprompt.rollout import GenerationRequest, derive_seed


def seeded_sample(indices: Sequence[int], count: int | None, seed: int) -> list[int]:
    """`count` of `indices` chosen by `seed` (all of them, in order, when count is None or too big)."""
    if count is None or count >= len(indices):
        return list(indices)
    return sorted(random.Random(seed).sample(list(indices), count))


BAND = (0.2, 0.8)  # pass rates at which a group of samples is seldom all-right or all-wrong


@dataclass
class PassRateEstimate:
    attempts: list[int]  # per prompt: valid (scored) samples
    successes: list[int]  # per prompt: correct samples
    mean_length: list[float]  # per prompt: mean completion length (tokens)
    errors: int  # reward-function failures (scored None)

    def records(self, rows: list[dict]) -> list[tuple[str, int, int, float]]:
        """(prompt, attempts, successes, mean length) of every scored prompt: what the store records."""
        return [
            (row["prompt"], self.attempts[i], self.successes[i], self.mean_length[i])
            for i, row in enumerate(rows)
            if self.attempts[i]
        ]

    def rate(self, index: int) -> float | None:
        return self.successes[index] / self.attempts[index] if self.attempts[index] else None

    def by_level(self, rows: list[dict], band: tuple[float, float] = BAND) -> dict[str, dict[str, float]]:
        """Per value of the rows' `level` (rows without one are left out): prompts scored, their mean pass
        rate, and the shares never solved, always solved, and with a pass rate inside `band` (where a
        group of samples most often carries signal)."""
        rates: dict[str, list[float]] = {}
        for index, row in enumerate(rows):
            rate = self.rate(index)
            if row.get("level") is not None and rate is not None:
                rates.setdefault(str(row["level"]), []).append(rate)
        return {
            level: {
                "prompts": len(values),
                "mean_pass_rate": sum(values) / len(values),
                "never_solved": sum(v == 0 for v in values) / len(values),
                "always_solved": sum(v == 1 for v in values) / len(values),
                "in_band": sum(band[0] <= v <= band[1] for v in values) / len(values),
            }
            for level, values in sorted(rates.items(), key=lambda item: _level_order(item[0]))
        }


def _level_order(level: str) -> tuple[int, float | str]:
    """Numeric levels first, in numeric order, then the others by name."""
    try:
        return 0, float(level)
    except ValueError:
        return 1, level


def estimate_pass_rates(
    engine,
    tokenizer,
    rows: list[dict],
    rewards: RewardPool,
    samples: int,
    params,
    seed: int,
    correct_reward: float = 1.0,
    chunk: int = 1024,
    progress: Callable[[int], None] | None = None,
    prompt_format=None,
) -> PassRateEstimate:
    """ZVE stage 0: `samples` completions per prompt from `engine`, scored by `rewards`; per-prompt
    pass counts.

    Completions are generated `chunk` requests at a time; `progress(n)` is called after each chunk with
    the number of prompts it finished. `prompt_format` (data.formatting) renders the prompts (default:
    plain text).
    """
    prompt_format = prompt_format or PlainFormat(tokenizer)
    attempts = [0] * len(rows)
    successes = [0] * len(rows)
    lengths = [0.0] * len(rows)
    errors_before = rewards.stats.errors
    per_chunk = max(1, chunk // samples)
    for start in range(0, len(rows), per_chunk):
        block = list(range(start, min(start + per_chunk, len(rows))))
        prompt_ids = {i: prompt_format.prompt_ids(rows[i]) for i in block}
        owners = [i for i in block for _ in range(samples)]
        requests = [
            GenerationRequest(n, prompt_ids[i], derive_seed(seed, 0x51F7, i, s))
            for n, (i, s) in enumerate((i, s) for i in block for s in range(samples))
        ]
        scored = sample_and_score(
            engine, tokenizer, requests, params, [rows[i] for i in owners], rewards, start
        )
        for owner, completion, reward in zip(owners, scored.completions, scored.rewards):
            lengths[owner] += len(completion.token_ids) / samples
            if reward is not None:
                attempts[owner] += 1
                successes[owner] += int(reward >= correct_reward)
        if progress is not None:
            progress(len(block))
    return PassRateEstimate(attempts, successes, lengths, rewards.stats.errors - errors_before)


@dataclass
class FilterResult:
    kept: list[int]  # indices of prompts with low < p < high
    too_easy: int  # p >= high
    too_hard: int  # p <= low
    unscored: int  # no valid reward at all (dropped)
    histogram: dict[str, int]  # pass-rate value ("0.375") -> prompts


def filter_by_pass_rate(estimate: PassRateEstimate, low: float = 0.0, high: float = 1.0) -> FilterResult:
    """Keep prompts whose estimated pass rate lies strictly inside (low, high)."""
    kept, too_easy, too_hard, unscored = [], 0, 0, 0
    histogram: dict[str, int] = {}
    for index in range(len(estimate.attempts)):
        p = estimate.rate(index)
        if p is None:
            unscored += 1
            continue
        histogram[f"{p:.3f}"] = histogram.get(f"{p:.3f}", 0) + 1
        if p >= high:
            too_easy += 1
        elif p <= low:
            too_hard += 1
        else:
            kept.append(index)
    return FilterResult(kept, too_easy, too_hard, unscored, dict(sorted(histogram.items())))
