"""Advantage inversion: a noisy scalar reward model vs a ternary judge, on groups of known true quality.

Each group holds `group_size` responses whose true quality is known: 1 (right), 0.5 (partly right) or 0
(wrong). A share of the groups are of equal quality throughout (all right, all wrong or all partial),
the case where a scalar reward model's noise alone decides the advantages. Rewards:
  - scalar RM: true quality + Gaussian noise of sd sigma (the score a sequence-classification RM gives);
  - scalar RM with the dead zone delta (rl.dead_zone): |R - mean R| < delta gives advantage 0;
  - ternary judge (GenRM against the reference): the true verdict correct / partial / incorrect
    (+1 / 0 / -1), replaced by one of the two others with probability eps.
Advantages are GRPO's (group-normalised). Measured over the responses whose true quality differs from
their group's mean: the share whose advantage has the opposite sign (inversion), the share of right
answers pushed down; over the equal-quality groups: the mean |advantage| (ideally 0).

    python -m bench.quality.inversion            # seconds
Writes bench/results/inversion.json; prints the table last.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench.common import RESULTS, write_results

LEVELS = (0.0, 0.5, 1.0)  # true quality: wrong, partial, right


def make_groups(groups: int, group_size: int, equal_share: float, generator):
    """True qualities [groups * group_size] and group indices; the first `equal_share` of the groups are
    of one quality throughout, the rest draw each response's quality at random."""
    import torch

    levels = torch.tensor(LEVELS)
    equal = int(groups * equal_share)
    per_group = levels[torch.randint(3, (equal,), generator=generator)].repeat_interleave(group_size)
    mixed = levels[torch.randint(3, ((groups - equal) * group_size,), generator=generator)]
    quality = torch.cat([per_group, mixed])
    index = torch.arange(groups).repeat_interleave(group_size)
    return quality, index, torch.arange(groups) < equal


def scalar_rewards(quality, sigma: float, generator):
    import torch

    return quality + sigma * torch.randn(quality.shape, generator=generator)


def ternary_rewards(quality, eps: float, generator):
    """+1 / 0 / -1 for right / partial / wrong; with probability eps one of the two other verdicts."""
    import torch

    verdict = (quality * 2).long()  # 0 wrong, 1 partial, 2 right
    flip = torch.rand(quality.shape, generator=generator) < eps
    other = (verdict + torch.randint(1, 3, quality.shape, generator=generator)) % 3
    verdict = torch.where(flip, other, verdict)
    return verdict.float() - 1.0


def measure(rewards, quality, index, equal_groups, dead_zone: float = 0.0) -> dict:
    import torch

    from everyprompt.algorithms import compute_advantages

    advantages = compute_advantages("grpo", rewards, index, dead_zone=dead_zone)
    group_mean = torch.zeros(int(index.max()) + 1).index_add_(0, index, quality) / torch.bincount(index)
    true = quality - group_mean[index]
    informative = true.abs() > 1e-9
    equal_rows = equal_groups[index]
    return {
        "inversion_rate": float(((advantages * true) < 0)[informative].float().mean()),
        "zeroed_rate": float((advantages == 0)[informative].float().mean()),
        "right_pushed_down": float((advantages < 0)[informative & (quality == 1.0)].float().mean()),
        "equal_quality_mean_abs_advantage": float(advantages[equal_rows].abs().mean()),
        "equal_quality_nonzero_share": float((advantages[equal_rows] != 0).float().mean()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=20000)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--equal-share", type=float, default=0.3, help="share of equal-quality groups")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    import torch
    from rich.console import Console
    from rich.table import Table

    started = time.perf_counter()
    generator = torch.Generator().manual_seed(args.seed)
    quality, index, equal_groups = make_groups(args.groups, args.group_size, args.equal_share, generator)
    rows = []
    for sigma in (0.05, 0.1, 0.3):
        rewards = scalar_rewards(quality, sigma, generator)
        rows.append(
            {"reward": f"scalar RM, noise sd {sigma}", **measure(rewards, quality, index, equal_groups)}
        )
        delta = 2 * sigma
        rows.append(
            {
                "reward": f"scalar RM, noise sd {sigma}, dead zone {delta:g}",
                **measure(rewards, quality, index, equal_groups, dead_zone=delta),
            }
        )
    for eps in (0.0, 0.05, 0.15):
        rewards = ternary_rewards(quality, eps, generator)
        rows.append(
            {"reward": f"ternary judge, error rate {eps}", **measure(rewards, quality, index, equal_groups)}
        )
    payload = {
        "benchmark": "inversion",
        "groups": args.groups,
        "group_size": args.group_size,
        "equal_share": args.equal_share,
        "rows": rows,
        "wall_seconds": time.perf_counter() - started,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_results(args.out / "inversion.json", payload)
    table = Table(
        title=f"Advantage sign vs true quality ({args.groups} groups of {args.group_size}, "
        f"{args.equal_share:.0%} of equal quality)"
    )
    for column in (
        "reward",
        "inverted sign",
        "zeroed",
        "right answers pushed down",
        "equal-quality mean |A|",
        "equal-quality A != 0",
    ):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row["reward"],
            f"{row['inversion_rate']:.1%}",
            f"{row['zeroed_rate']:.1%}",
            f"{row['right_pushed_down']:.1%}",
            f"{row['equal_quality_mean_abs_advantage']:.3f}",
            f"{row['equal_quality_nonzero_share']:.1%}",
        )
    console = Console(width=160)
    console.print(f"wrote {args.out / 'inversion.json'}")
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
