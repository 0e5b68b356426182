"""Whether the reward function works: each distinct failure reported once per step, and a run whose
reward is broken stopped with its traceback."""

from __future__ import annotations

import logging
from collections import deque

from everyprompt.rewards.base import RewardError, RewardFailure, summarize_failures

log = logging.getLogger(__name__)


class RewardHealth:
    """Reports each distinct reward failure once per step, and stops a run whose reward is broken: every
    reward of a step failed, or more than `max_error_fraction` of those of the last `window` steps."""

    def __init__(self, max_error_fraction: float, window: int):
        self.max_error_fraction = max_error_fraction
        self.recent: deque[tuple[int, int]] = deque(maxlen=window)  # (failed, scored) per step

    def check(self, step: int, failures: list[RewardFailure], scored: int) -> None:
        distinct = summarize_failures(failures)
        for summary, (count, first) in distinct.items():
            log.warning(
                "step %d: %d of %d rewards failed with %s; first:\n%s",
                step,
                count,
                scored,
                summary,
                first.traceback,
            )
        self.recent.append((len(failures), scored))
        failed, total = (sum(column) for column in zip(*self.recent))
        every = scored > 0 and len(failures) >= scored
        too_many = len(self.recent) == self.recent.maxlen and failed > self.max_error_fraction * total
        if every or too_many:
            summary, (count, first) = next(iter(distinct.items()), ("", (0, RewardFailure(""))))
            why = (
                f"every reward of step {step} failed"
                if every
                else (
                    f"{failed} of the {total} rewards of the last {len(self.recent)} steps failed "
                    f"(rewards.max_error_fraction={self.max_error_fraction:g})"
                )
            )
            raise RewardError(f"{why}; the reward function is broken: {count} x {summary}\n{first.traceback}")
