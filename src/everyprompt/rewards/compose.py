"""Reward composition: several reward functions with weights (e.g. math verification + format + a judge),
each component reported on its own (`reward/<name>`).

A component that is None for a row (could not be scored) follows `missing`: `skip` makes the row's total
None (left out of its group's statistics), `zero` counts the component as 0 (the row is None only when
every component is).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from everyprompt.rewards.base import RewardFailure, score_completions


class CompositeReward:
    """`fn(completions, **columns) -> totals`; `score_with_components` also returns each component."""

    def __init__(
        self, components: list[tuple[str, Callable, float]], missing: Literal["skip", "zero"] = "skip"
    ):
        if not components:
            raise ValueError("a composite reward needs at least one component")
        names = [name for name, _, _ in components]
        if len(set(names)) != len(names):
            raise ValueError(f"reward component names must be unique, got {names}")
        if missing not in ("skip", "zero"):
            raise ValueError(f"rewards.missing must be 'skip' or 'zero', got {missing!r}")
        self.components, self.missing = components, missing

    def score_with_components(
        self, completions: list[str], **columns
    ) -> tuple[list[float | None], list[dict[str, float | None]], list[RewardFailure]]:
        """(totals, per-row component values, the failures of every component)."""
        per_component = {}
        failed = []
        for name, fn, _ in self.components:
            values, errors = score_completions(fn, completions, columns)
            per_component[name] = values
            failed.extend(errors)
        totals: list[float | None] = []
        rows: list[dict[str, float | None]] = []
        for i in range(len(completions)):
            row = {name: per_component[name][i] for name, _, _ in self.components}
            present = [v is not None for v in row.values()]
            if (self.missing == "skip" and not all(present)) or not any(present):
                totals.append(None)
            else:
                totals.append(sum(w * (row[name] or 0.0) for name, _, w in self.components))
            rows.append(row)
        return totals, rows, failed

    def __call__(self, completions: list[str], **columns) -> list[float | None]:
        return self.score_with_components(completions, **columns)[0]
