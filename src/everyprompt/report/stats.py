"""Statistics across seeds: mean, sample standard deviation, bootstrap and Student-t intervals of a
difference, and the verdict rules of docs/evidence.md (as first written: a percentile bootstrap; amended
2026-11-27: a paired t-test with Holm's adjustment within a comparison).

Values that are NaN or infinite (a run that never evaluated, a metric that diverged) are left out and
counted, never averaged in. The interval of an arm's difference to the reference arm resamples each arm's
seeds with replacement, independently (a percentile bootstrap, `RESAMPLES` draws from a fixed generator,
so a report is the same every time it is drawn); it needs at least two seeds in both arms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RESAMPLES = 10_000
LEVEL = 0.95


def finite(values) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v)]


@dataclass(frozen=True)
class Spread:
    """The finite values of one metric across an arm's runs."""

    values: tuple[float, ...]
    left_out: int  # runs whose value is missing, NaN or infinite

    @classmethod
    def of(cls, values) -> Spread:
        values = list(values)
        kept = finite(values)
        return cls(tuple(kept), len(values) - len(kept))

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return sum(self.values) / self.n if self.values else float("nan")

    @property
    def sd(self) -> float:
        """Sample standard deviation (n - 1); NaN below two values."""
        if self.n < 2:
            return float("nan")
        mean = self.mean
        return math.sqrt(sum((v - mean) ** 2 for v in self.values) / (self.n - 1))


@dataclass(frozen=True)
class Difference:
    """mean(arm) - mean(reference), and its bootstrap interval (None with fewer than two seeds a side)."""

    value: float
    low: float | None
    high: float | None


def bootstrap_difference(
    arm: Spread, reference: Spread, resamples: int = RESAMPLES, level: float = LEVEL, seed: int = 0
) -> Difference:
    """Percentile bootstrap of mean(arm) - mean(reference), each side resampled on its own."""
    import numpy as np  # (here: the CLI's tables import this module, and numpy costs ~0.6 s)

    value = arm.mean - reference.mean
    if arm.n < 2 or reference.n < 2:
        return Difference(value, None, None)
    generator = np.random.default_rng(seed)
    a, r = np.asarray(arm.values), np.asarray(reference.values)
    draws_a = a[generator.integers(0, a.size, size=(resamples, a.size))].mean(axis=1)
    draws_r = r[generator.integers(0, r.size, size=(resamples, r.size))].mean(axis=1)
    return _percentile_interval(value, draws_a - draws_r, level)


def paired_bootstrap(
    differences, resamples: int = RESAMPLES, level: float = LEVEL, seed: int = 0
) -> Difference:
    """Percentile bootstrap of the mean of per-seed `differences` (arm minus reference, same seed): the
    seeds resampled with replacement `resamples` times (docs/evidence.md's statistic). No interval
    below two differences."""
    import numpy as np  # (here: the CLI's tables import this module, and numpy costs ~0.6 s)

    values = np.asarray(finite(differences), dtype=float)
    if values.size == 0:
        return Difference(math.nan, None, None)
    value = float(values.mean())
    if values.size < 2:
        return Difference(value, None, None)
    draws = values[np.random.default_rng(seed).integers(0, values.size, size=(resamples, values.size))]
    return _percentile_interval(value, draws.mean(axis=1), level)


def _percentile_interval(value: float, draws, level: float) -> Difference:
    """`value` with the central `level` interval of its bootstrap `draws`."""
    import numpy as np  # (here: the CLI's tables import this module, and numpy costs ~0.6 s)

    tail = (1 - level) / 2 * 100
    low, high = np.percentile(draws, [tail, 100 - tail])
    return Difference(value, float(low), float(high))


VERDICTS = ("win", "loss", "no difference shown")


def verdict(difference: Difference) -> str | None:
    """docs/evidence.md's rule: a win when the interval lies above 0, a loss when below, else no
    difference shown; None without an interval."""
    if difference.low is None or difference.high is None:
        return None
    if difference.low > 0:
        return VERDICTS[0]
    if difference.high < 0:
        return VERDICTS[1]
    return VERDICTS[2]


def t_interval(spread: Spread, level: float = LEVEL) -> tuple[float, float] | None:
    """The Student-t interval of the mean of `spread` (None below two values): with few seeds it is wide,
    as it should be (3 seeds, 95%: mean +- 4.30 sd / sqrt(3))."""
    from scipy import stats

    if spread.n < 2:
        return None
    half = stats.t.ppf((1 + level) / 2, spread.n - 1) * spread.sd / math.sqrt(spread.n)
    return spread.mean - half, spread.mean + half


# ---------------------------------------------------------------- the verdict rules of docs/evidence.md
MIN_PAIRS = 3  # the amended rule judges no contrast on fewer seed pairs
ALPHA = 0.05  # its family-wise level


@dataclass(frozen=True)
class PairedT:
    """The paired t-test of per-seed differences: their mean, its t-interval and the two-sided p-value of
    "mean = 0" (None below two differences; p is 1 when every difference is 0 and NaN-free)."""

    n: int
    value: float
    low: float | None
    high: float | None
    p: float | None


def paired_t(differences, level: float = LEVEL) -> PairedT:
    from scipy import stats

    spread = Spread.of(differences)
    if spread.n < 2:
        return PairedT(spread.n, spread.mean, None, None, None)
    low, high = t_interval(spread, level)
    if spread.sd == 0:  # every seed the same difference: certain of its sign unless it is 0
        return PairedT(spread.n, spread.mean, low, high, 1.0 if spread.mean == 0 else 0.0)
    statistic = spread.mean / (spread.sd / math.sqrt(spread.n))
    return PairedT(spread.n, spread.mean, low, high, float(2 * stats.t.sf(abs(statistic), spread.n - 1)))


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjustment of a family's p-values (in their order): the k-th smallest is
    multiplied by (m - k + 1), made non-decreasing, capped at 1. Rejecting where the adjusted value is
    below alpha keeps the chance of any false rejection in the family at most alpha."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


def t_verdict(mean: float, p_adjusted: float | None, alpha: float = ALPHA) -> str | None:
    """The amended rule (docs/evidence.md, 2026-11-27): a win or a loss when the family-adjusted p-value
    is below `alpha`, by the sign of the mean difference; else no difference shown."""
    if p_adjusted is None:
        return None
    if p_adjusted < alpha:
        return VERDICTS[0] if mean > 0 else VERDICTS[1]
    return VERDICTS[2]


@dataclass(frozen=True)
class Rule:
    name: str  # as the README and the evidence page name it
    since: str  # the date docs/evidence.md wrote it


RULES = {
    "as-first-written": Rule("95% percentile bootstrap, no correction", "2026-11-26"),
    "amended": Rule("paired t-test, Holm within a comparison", "2026-11-27"),
}
