"""The RL prompt source: seeded order, difficulty buckets for the curriculum, retired prompts skipped.

Prompts are split into buckets (one bucket when there is no curriculum); each bucket walks its own
`PromptCursor`. `take(count, mixture)` splits `count` over the buckets by the mixture's weights (largest
remainder) and skips prompts the pass-rate store has retired or deferred. A bucket with nothing left
to give passes its share to the others; when no bucket has anything left it is an error, not a hang.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from everyprompt.data.datasets import DataError, PromptCursor

ALL = "all"


def split_counts(count: int, weights: dict[str, float]) -> dict[str, int]:
    """`count` split by `weights` with largest remainders (ties to the earlier key): sums to `count`."""
    total = sum(weights.values())
    if total <= 0:
        raise ValueError("mixture weights must have a positive sum")
    exact = {key: count * w / total for key, w in weights.items()}
    counts = {key: math.floor(v) for key, v in exact.items()}
    order = sorted(exact, key=lambda key: (-(exact[key] - counts[key]), list(exact).index(key)))
    for key in order[: count - sum(counts.values())]:
        counts[key] += 1
    return counts


class PromptSource:
    """Draws RL prompt indices by bucket; `available(index)` says whether a prompt may be drawn now."""

    def __init__(self, buckets: dict[str, list[int]], seed: int):
        self.seed = seed
        self.set_buckets(buckets)

    def set_buckets(self, buckets: dict[str, list[int]]) -> None:
        """Replace the buckets (a new curriculum stage); each non-empty bucket gets a fresh cursor."""
        self.buckets = {key: list(indices) for key, indices in buckets.items() if indices}
        if not self.buckets:
            raise DataError("the RL prompt set is empty")
        self._cursors = {
            key: PromptCursor(len(indices), self.seed + 7919 * number)
            for number, (key, indices) in enumerate(sorted(self.buckets.items()))
        }

    def take(
        self,
        count: int,
        mixture: dict[str, float] | None = None,
        available: Callable[[int], bool] | None = None,
    ) -> list[int]:
        """`count` prompt indices, by `mixture` (bucket -> weight; None: all buckets alike)."""
        weights = {k: w for k, w in (mixture or dict.fromkeys(self.buckets, 1.0)).items() if w > 0}
        unknown = sorted(set(weights) - set(self.buckets))
        if unknown:
            raise DataError(
                f"curriculum mixture names bucket(s) {unknown} with no prompts; buckets: {sorted(self.buckets)}"
            )
        out: list[int] = []
        exhausted: set[str] = set()
        while len(out) < count:
            live = {k: w for k, w in weights.items() if k not in exhausted}
            if not live:
                raise DataError(
                    "every RL prompt of the mixture's buckets is retired, deferred or in flight (partial "
                    "rollouts); widen the mixture, lower zve.retirement or rl.prompts_per_step, or add prompts"
                )
            for key, share in split_counts(count - len(out), live).items():
                got = self._take_from(key, share, available)
                if len(got) < share:
                    exhausted.add(key)
                out.extend(got)
        return out

    def _take_from(self, key: str, count: int, available: Callable[[int], bool] | None) -> list[int]:
        cursor, indices = self._cursors[key], self.buckets[key]
        out: list[int] = []
        misses = 0
        while len(out) < count and misses < len(indices):  # a full pass without a hit: nothing left
            index = indices[cursor.take(1)[0]]
            if available is None or available(index):
                out.append(index)
                misses = 0
            else:
                misses += 1
        return out

    def state_dict(self) -> dict:
        return {
            "buckets": self.buckets,
            "cursors": {key: cursor.state_dict() for key, cursor in self._cursors.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.set_buckets(state["buckets"])
        for key, cursor_state in state["cursors"].items():
            self._cursors[key].load_state_dict(cursor_state)


def buckets_by_field(rows: list[dict], field: str) -> dict[str, list[int]]:
    """Prompt indices grouped by the string value of `field`; a row without it is a DataError."""
    buckets: dict[str, list[int]] = {}
    for index, row in enumerate(rows):
        value = row.get(field)
        if value is None:
            raise DataError(f"RL prompt {index + 1} has no {field!r} field for the curriculum's buckets")
        buckets.setdefault(str(value), []).append(index)
    return buckets


def buckets_by_pass_rate(
    rows: list[dict], pass_rate: Callable[[str], float | None], edges: tuple[float, float]
) -> dict[str, list[int]]:
    """hard (p < edges[0]), medium, easy (p >= edges[1]) and unknown (never attempted)."""
    buckets: dict[str, list[int]] = {"hard": [], "medium": [], "easy": [], "unknown": []}
    for index, row in enumerate(rows):
        p = pass_rate(row["prompt"])
        key = "unknown" if p is None else "hard" if p < edges[0] else "easy" if p >= edges[1] else "medium"
        buckets[key].append(index)
    return buckets
