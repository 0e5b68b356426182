"""Length-aware scheduling (docs/rollout.md): predict each prompt's completion length, admit the
longest first, and balance several engine workers by longest-processing-time-first.

A batch's wall time is set by its longest sequences. Admitted last, a long sequence decodes alone while
the other slots sit idle; admitted first, it runs while the short ones cycle through the other slots.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Literal

from everyprompt.data.passrate import PassRateStore

SchedulePolicy = Literal["fifo", "longest_first"]
POLICIES: tuple[str, ...] = ("fifo", "longest_first")


class LengthPredictor:
    """Predicted completion length of a prompt: its own mean in the pass-rate store, else its difficulty
    bucket's running mean, else `default` (the generation cap: an unknown prompt is assumed long, so it
    is never left to the end of a batch)."""

    def __init__(self, store: PassRateStore | None, default: float):
        self.store, self.default = store, float(default)
        self._bucket_sum: dict[str, float] = {}
        self._bucket_count: dict[str, int] = {}

    def observe(self, bucket: str | None, lengths: Sequence[int]) -> None:
        """Fold one group's completion lengths into its bucket's mean (the store keeps per-prompt means)."""
        if bucket is None or not lengths:
            return
        self._bucket_sum[bucket] = self._bucket_sum.get(bucket, 0.0) + float(sum(lengths))
        self._bucket_count[bucket] = self._bucket_count.get(bucket, 0) + len(lengths)

    def bucket_mean(self, bucket: str | None) -> float | None:
        count = self._bucket_count.get(bucket, 0) if bucket is not None else 0
        return self._bucket_sum[bucket] / count if count else None

    def predict(self, prompt: str, bucket: str | None = None) -> float:
        stats = self.store.get(prompt) if self.store is not None else None
        if stats is not None and stats.attempts > 0:
            return stats.mean_length
        mean = self.bucket_mean(bucket)
        return mean if mean is not None else self.default

    def state_dict(self) -> dict:
        return {"sum": dict(self._bucket_sum), "count": dict(self._bucket_count)}

    def load_state_dict(self, state: dict) -> None:
        self._bucket_sum, self._bucket_count = dict(state["sum"]), dict(state["count"])


def admission_order(predicted: Sequence[float], policy: SchedulePolicy) -> list[int]:
    """Indices in the order the engine should admit them: as given (`fifo`), or longest predicted first
    (`longest_first`; ties keep their given order)."""
    if policy == "fifo":
        return list(range(len(predicted)))
    if policy == "longest_first":
        return sorted(range(len(predicted)), key=lambda i: -predicted[i])
    raise ValueError(f"schedule policy must be one of {', '.join(POLICIES)}, got {policy!r}")


def assign_lpt(predicted: Sequence[float], workers: int) -> list[list[int]]:
    """Longest-processing-time-first: jobs by decreasing predicted length, each to the worker with the
    least predicted load so far (ties to the lowest worker index). Returns each worker's job indices in
    the order assigned, which is also longest-first within a worker."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    loads = [(0.0, w) for w in range(workers)]
    heapq.heapify(loads)
    assignment: list[list[int]] = [[] for _ in range(workers)]
    for job in admission_order(predicted, "longest_first"):
        load, worker = heapq.heappop(loads)
        assignment[worker].append(job)
        heapq.heappush(loads, (load + predicted[job], worker))
    return assignment
