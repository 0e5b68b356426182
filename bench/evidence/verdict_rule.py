"""How often docs/evidence.md's verdict rules give a verdict when there is no effect, and how often the
amended rule finds an effect that is there: a simulation of per-seed differences, seconds on a CPU.

    python -m bench.evidence.verdict_rule                 # the tables docs/evidence.md quotes: bench/results/verdict_rule.json
    python -m bench.evidence.verdict_rule --reps 2000     # quicker, noisier

Under no effect the per-seed differences are drawn from a normal, a Student t with 3 degrees of freedom
(heavy tails) and a Laplace distribution, each scaled to a standard deviation of 0.5, 2 or 5 points; a
rule's false-verdict rate is the share of draws it calls a win or a loss. The rules: as first written (a
95% percentile bootstrap of the mean, 1,000 resamples here against the plan's 10,000: the same quantiles
up to resampling noise), and as amended (the paired t-test at 5%; in a family of two contrasts that share
their baseline, Holm's adjustment). Power: normal differences with a true mean of 1, 2 or 4 points at the
spreads the runs showed, from the noncentral t distribution (exact) and checked by simulation.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from bench.common import RESULTS, repo_path, write_results

SEEDS = (3, 6, 10)
SPREADS = (0.5, 2.0, 5.0)  # points: the sd of the per-seed differences
EFFECTS = (1.0, 2.0, 4.0)  # points
# the sd of the per-seed differences the runs showed (bench/results/evidence.json): the tiny model's
# contrasts (about 1.2), SmolLM2's pooled over its contrasts (1.7) and C1 SmolLM2 ESPO's (2.8)
OBSERVED_SD = {"tiny": 1.2, "smollm2": 1.7, "smollm2-espo": 2.8}
ALPHA = 0.05


def draws(kind: str, sd: float, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Differences with mean 0 and standard deviation `sd`."""
    if kind == "normal":
        return rng.normal(0.0, sd, shape)
    if kind == "t3":  # variance 3 for unit scale
        return rng.standard_t(3, shape) * sd / math.sqrt(3)
    if kind == "laplace":  # variance 2 b^2
        return rng.laplace(0.0, sd / math.sqrt(2), shape)
    raise ValueError(kind)


KINDS = ("normal", "t3", "laplace")


def t_p_values(d: np.ndarray) -> np.ndarray:
    """Two-sided p-values of the paired t-test of each row of `d` (rows: draws, columns: seeds): scipy's,
    vectorised; report/stats.paired_t gives the same per row (tested)."""
    from scipy import stats

    return stats.ttest_1samp(d, 0.0, axis=1).pvalue


def t_rule(d: np.ndarray) -> np.ndarray:
    """Whether the amended rule gives a verdict (win or loss) on each row, a family of one."""
    return t_p_values(d) < ALPHA


def bootstrap_rule(d: np.ndarray, resamples: int) -> np.ndarray:
    """Whether the rule as first written (report/stats.paired_bootstrap and verdict, as the evidence bench
    calls them, but `resamples` draws) gives a verdict on each row."""
    from everyprompt.report.stats import VERDICTS, paired_bootstrap, verdict

    return np.array([verdict(paired_bootstrap(row, resamples)) != VERDICTS[2] for row in d])


def holm_family_rule(n: int, reps: int, rng: np.random.Generator) -> tuple[float, float]:
    """(Holm, uncorrected) rates of any verdict in a family of two contrasts with no effect that share
    their baseline (each arm's runs i.i.d. normal: the two differences correlate 0.5)."""
    from everyprompt.report.stats import holm

    base, a, b = (rng.normal(0.0, 1.0, (reps, n)) for _ in range(3))
    p = np.stack([t_p_values(a - base), t_p_values(b - base)], axis=1)
    holm_any = np.array([min(holm(list(row))) < ALPHA for row in p])
    return float(holm_any.mean()), float((p.min(axis=1) < ALPHA).mean())


def power_exact(n: int, effect: float, sd: float, alpha: float = ALPHA) -> float:
    """The paired t-test's power against a true mean `effect` (normal differences, sd `sd`)."""
    from scipy import stats

    df, shift = n - 1, effect / (sd / math.sqrt(n))
    q = stats.t.ppf(1 - alpha / 2, df)
    return float(stats.nct.sf(q, df, shift) + stats.nct.cdf(-q, df, shift))


def seeds_for(effect: float, sd: float, power: float = 0.8, alpha: float = ALPHA) -> int:
    """The fewest seed pairs at which the t-test reaches `power` against `effect`."""
    return next(n for n in range(2, 10_000) if power_exact(n, effect, sd, alpha) >= power)


def false_verdict_rates(reps: int, resamples: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for kind in KINDS:
        for sd in SPREADS:
            for n in SEEDS:
                d = draws(kind, sd, (reps, n), rng)
                rows.append(
                    {
                        "distribution": kind,
                        "sd": sd,
                        "seeds": n,
                        "amended": float(t_rule(d).mean()),
                        "as_first_written": float(bootstrap_rule(d, resamples).mean()),
                    }
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=20_000, help="simulated experiments a cell")
    parser.add_argument("--resamples", type=int, default=1_000, help="bootstrap resamples of the old rule")
    parser.add_argument("--out", type=Path, default=RESULTS / "verdict_rule.json")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(1)
    rates = false_verdict_rates(args.reps, args.resamples)
    family = {n: holm_family_rule(n, args.reps, rng) for n in SEEDS}
    power = {
        name: {f"{effect:g}": {n: power_exact(n, effect, sd) for n in SEEDS} for effect in EFFECTS}
        for name, sd in OBSERVED_SD.items()
    }
    needed = {
        name: {
            f"{effect:g}": [seeds_for(effect, sd), seeds_for(effect, sd, alpha=ALPHA / 2)]
            for effect in EFFECTS
        }
        for name, sd in OBSERVED_SD.items()
    }
    print(f"false-verdict rate under no effect ({args.reps} experiments a cell): amended / as first written")
    for row in rates:
        print(
            f"  {row['distribution']:8s} sd {row['sd']:>3g}  {row['seeds']:>2d} seeds: "
            f"{100 * row['amended']:5.1f}% / {100 * row['as_first_written']:5.1f}%"
        )
    print("a family of two contrasts sharing their baseline, any false verdict: Holm / uncorrected")
    for n, (holm_rate, plain) in family.items():
        print(f"  {n:>2d} seeds: {100 * holm_rate:.1f}% / {100 * plain:.1f}%")
    print("power of the amended rule (a family of one), normal differences: at 3 / 6 / 10 seeds")
    for name, by_effect in power.items():
        for effect, by_n in by_effect.items():
            print(
                f"  sd {OBSERVED_SD[name]:g} ({name}), effect {effect} points: "
                + " / ".join(f"{100 * by_n[n]:.0f}%" for n in SEEDS)
                + f"; 80% at {needed[name][effect][0]} seeds ({needed[name][effect][1]} at Holm's 2.5%)"
            )
    write_results(
        args.out,
        {
            "benchmark": "verdict_rule",
            "command": f"python -m bench.evidence.verdict_rule --reps {args.reps} --resamples {args.resamples}",
            "false_verdict_rates": rates,
            "family_of_two": {str(n): {"holm": h, "uncorrected": p} for n, (h, p) in family.items()},
            "power": {
                name: {e: {str(n): v for n, v in by.items()} for e, by in be.items()}
                for name, be in power.items()
            },
            "seeds_for_80_percent_power": needed,
            "observed_sd": OBSERVED_SD,
        },
    )
    print(f"wrote {repo_path(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
