"""docs/evidence.md's verdict rules under simulation (bench/evidence/verdict_rule.py, seconds): with no effect, the
amended rule (paired t-test, Holm in a family) gives a verdict at most as often as it says (5% plus
Monte-Carlo error, for normal and heavy-tailed differences at 3, 6 and 10 seeds), where the rule as first
written (a percentile bootstrap) gives one about a quarter of the time at 3 seeds; its power is what the
noncentral t distribution says."""

from __future__ import annotations

import math

import numpy as np
import pytest

from everyprompt.report.stats import paired_t
from tests.test_bench import _load

REPS = 4000
BOUND = 0.05 + 3 * math.sqrt(0.05 * 0.95 / REPS)  # the nominal level plus three Monte-Carlo errors


@pytest.fixture(scope="module")
def bench():
    return _load("evidence.verdict_rule")


def test_the_simulations_t_test_is_the_reports(bench):
    rng = np.random.default_rng(0)
    d = rng.normal(0.0, 2.0, (20, 4))  # continuous draws: no row without spread (paired_t's own case)
    expected = [paired_t(row).p for row in d]
    assert bench.t_p_values(d) == pytest.approx(expected, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("kind", ["normal", "t3", "laplace"])
def test_with_no_effect_the_amended_rule_errs_at_most_as_often_as_it_says(bench, kind):
    rng = np.random.default_rng(7)
    for sd in bench.SPREADS:
        for n in bench.SEEDS:
            rate = bench.t_rule(bench.draws(kind, sd, (REPS, n), rng)).mean()
            assert rate <= BOUND, f"{kind}, sd {sd}, {n} seeds: {rate:.3f} false verdicts"


def test_the_rule_as_first_written_errs_about_a_quarter_of_the_time_at_three_seeds(bench):
    rng = np.random.default_rng(3)
    for kind in ("normal", "t3"):
        d = bench.draws(kind, 2.0, (2000, 3), rng)
        rate = bench.bootstrap_rule(d, 500).mean()
        assert 0.20 <= rate <= 0.30, f"{kind}: {rate:.3f}"  # all three of one sign: 1/4 by chance
        assert bench.t_rule(d).mean() <= BOUND


def test_holm_keeps_a_family_of_two_at_its_level_where_no_correction_does_not(bench):
    for n in bench.SEEDS:
        holm_rate, plain = bench.holm_family_rule(n, REPS, np.random.default_rng(n))
        assert holm_rate <= BOUND < plain, (n, holm_rate, plain)


def test_power_by_the_noncentral_t_matches_a_simulation(bench):
    rng = np.random.default_rng(11)
    for n, effect, sd in [(3, 4.0, 1.7), (6, 2.0, 1.7), (10, 2.0, 2.8)]:
        exact = bench.power_exact(n, effect, sd)
        simulated = bench.t_rule(rng.normal(effect, sd, (REPS, n))).mean()
        assert simulated == pytest.approx(exact, abs=3 * math.sqrt(exact * (1 - exact) / REPS))
    assert bench.seeds_for(2.0, 1.7) == 8 and bench.power_exact(8, 2.0, 1.7) >= 0.8 > bench.power_exact(
        7, 2.0, 1.7
    )
