"""Statistics across seeds: mean, sample standard deviation, and a bootstrap interval of a difference.

Values that are NaN or infinite (a run that never evaluated, a metric that diverged) are left out and
counted, never averaged in. The interval of an arm's difference to the reference arm resamples each arm's
seeds with replacement, independently (a percentile bootstrap, `RESAMPLES` draws from a fixed generator,
so a report is the same every time it is drawn); it needs at least two seeds in both arms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

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


# two-sided 95% quantiles of Student's t by degrees of freedom (standard tables); 1.96 beyond 30
_T975 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    11: 2.201,
    12: 2.179,
    13: 2.160,
    14: 2.145,
    15: 2.131,
    16: 2.120,
    17: 2.110,
    18: 2.101,
    19: 2.093,
    20: 2.086,
    21: 2.080,
    22: 2.074,
    23: 2.069,
    24: 2.064,
    25: 2.060,
    26: 2.056,
    27: 2.052,
    28: 2.048,
    29: 2.045,
    30: 2.042,
}


def t_interval(spread: Spread) -> tuple[float, float] | None:
    """The 95% Student-t interval of the mean of `spread` (None below two values): with few seeds it is
    wide, as it should be (3 seeds: mean +- 4.30 sd / sqrt(3))."""
    if spread.n < 2:
        return None
    half = _T975.get(spread.n - 1, 1.96) * spread.sd / math.sqrt(spread.n)
    return spread.mean - half, spread.mean + half
