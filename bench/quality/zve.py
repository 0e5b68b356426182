"""Zero-variance elimination: (a) the binomial law on a synthetic bandit, (b) GRPO vs ZVE on the demo task.

(a) Prompts with known pass rates p and Bernoulli rewards, sampled through `zve.collect_groups`: the
    measured zero-variance rate of groups of N must match p^N + (1 - p)^N, and expansion to N_max must
    leave the rate of p^N_max + (1 - p)^N_max.
(b) The demo task on all five levels (easy levels ~100% solved after SFT, hard ones not), from one SFT
    checkpoint, three seeds, the same total rollout budget (`rl.max_rollouts`; the offline filter's
    samples count in it): plain GRPO against the ZVE stack with and without its offline filter.

    python -m bench.quality.zve                # the full benchmark (~25 minutes on 2 CPU cores)
    python -m bench.quality.zve --budget 6400  # shorter
    python -m bench.quality.zve --tiny         # seconds: a smoke run on a 2-layer model

The runs of (b) are the cells of one sweep (docs/sweeps.md) under bench/results/zve_runs/sweep/. Writes
bench/results/zve.json and bench/results/zve.png (held-out accuracy vs rollouts, zero-variance
rate per stage); prints the summary table last.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from bench.common import RESULTS, write_results
from bench.quality.algorithms import (  # shared bench helpers
    TINY,
    accuracy_cells,
    nan_mean,
    prepare_sft,
    records_of,
    repo_path,
    run_arms,
    start_evaluation,
)

ZVE_ONLINE = [
    "zve.enabled=true",
    "zve.expansion.max_group_size=16",
    "zve.expansion.step=8",
]
METHODS: dict[str, list[str]] = {
    "GRPO": [],
    "ZVE": ZVE_ONLINE,
    "ZVE+filter": [
        *ZVE_ONLINE,
        "zve.filter.enabled=true",
        "zve.filter.samples=4",
        "zve.filter.max_prompts=400",
    ],
}
STAGES = (
    ("sampled (N0)", "zve/zero_variance_rate"),
    ("expanded", "zve/zero_variance_rate_expanded"),
    ("reshaped", "zve/zero_variance_rate_reshaped"),
    ("final", "zve/zero_variance_rate_final"),
)


# ---------------------------------------------------------------------------- (a) the bandit
def bandit(trials: int = 4000, seed: int = 0) -> list[dict]:
    """Measured vs predicted zero-variance rates for p in 0.05..0.95 and N in 4, 8, 16 (+ expansion 8->16)."""
    from everyprompt.zve import collect_groups

    rows = []
    rng = random.Random(seed)
    for p in (0.05, 0.2, 0.5, 0.8, 0.95):
        for n, n_max in ((4, None), (8, None), (16, None), (8, 16)):

            def take(count):
                return [0] * count

            def sample(specs, p=p):
                return [(None, float(rng.random() < p), None) for _ in specs]

            result = collect_groups(
                take,
                sample,
                prompts_per_step=trials,
                group_size=n,
                max_group_size=n_max,
                max_rollouts=trials * (n_max or n),
            )
            top = n_max or n
            rows.append(
                {
                    "p": p,
                    "N0": n,
                    "N_max": top,
                    "measured": result.zv_expanded,
                    "predicted": p**top + (1 - p) ** top,
                    "measured_at_N0": result.zv_sampled,
                    "predicted_at_N0": p**n + (1 - p) ** n,
                    "rollouts_per_group": result.generated / trials,
                }
            )
    return rows


# ---------------------------------------------------------------------------- (b) the demo task
def result_of(method: str, seed: int, run_dir: Path, wall: float, start: float) -> dict:
    """One run's figures, from the files it wrote (metrics.jsonl, eval.json, filter.json)."""
    history, final = records_of(run_dir)
    generated = sum(m["zve/generated_rollouts"] for m in history)
    # the offline filter's samples count in rollout/total from the first step on
    filter_rollouts = history[0]["rollout/total"] - history[0]["zve/generated_rollouts"]
    evals = [{"rollouts": filter_rollouts, "greedy_accuracy": start}]
    for metrics in history:
        if "eval/greedy_accuracy" in metrics:
            evals.append(
                {"rollouts": metrics["rollout/total"], "greedy_accuracy": metrics["eval/greedy_accuracy"]}
            )
    evals.append({"rollouts": history[-1]["rollout/total"], "greedy_accuracy": final["greedy_accuracy"]})

    def weighted(key: str) -> float:  # rollout-weighted mean over steps
        return sum(m[key] * m["zve/generated_rollouts"] for m in history if key in m) / generated

    filtered = run_dir / "filter.json"
    return {
        "method": method,
        "seed": seed,
        "steps": len(history),
        "rollouts": history[-1]["rollout/total"],
        "filter_rollouts": filter_rollouts,
        "prompts": json.loads(filtered.read_text())["kept"] if filtered.is_file() else None,
        "final_greedy_accuracy": final["greedy_accuracy"],
        "final_by_level": {k: v for k, v in final.items() if k.startswith("greedy_accuracy/")},
        "evals": evals,
        "zero_variance": {
            name: nan_mean([m.get(key, float("nan")) for m in history]) for name, key in STAGES
        },
        "informative_rollout_fraction": weighted("zve/informative_rollout_fraction"),
        "signal_rollout_fraction": weighted("zve/signal_rollout_fraction"),
        "rollouts_per_signal_group": generated
        / max(1.0, sum(m.get("zve/signal_groups", 0.0) for m in history)),
        "retired": history[-1]["zve/retired_total"],
        "wall_seconds": wall,
        "run_dir": repo_path(run_dir),
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = dict(zip(METHODS, ("tab:blue", "tab:orange", "tab:green")))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for method in METHODS:
        runs = [r for r in results if r["method"] == method]
        for index, run in enumerate(runs):
            left.plot(
                [e["rollouts"] for e in run["evals"]],
                [100 * e["greedy_accuracy"] for e in run["evals"]],
                color=colours[method],
                marker="o",
                ms=3,
                alpha=0.8,
                label=method if index == 0 else None,
            )
    left.set_xlabel("rollouts generated (offline filter included)")
    left.set_ylabel("held-out greedy accuracy (%)")
    left.set_title("Accuracy at equal rollout budget")
    left.grid(alpha=0.3)
    left.legend()
    width = 0.25
    for offset, method in enumerate(m for m in METHODS if any(r["method"] == m for r in results)):
        runs = [r for r in results if r["method"] == method]
        values = [100 * nan_mean([r["zero_variance"][name] for r in runs]) for name, _ in STAGES]
        right.bar(
            [i + offset * width for i in range(len(STAGES))],
            values,
            width,
            color=colours[method],
            label=method,
        )
    right.set_xticks([i + width for i in range(len(STAGES))], [name for name, _ in STAGES])
    right.set_ylabel("zero-variance groups (%)")
    right.set_title("Zero-variance rate after each stage")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def tables(bandit_rows: list[dict], results: list[dict], start: float):
    from rich.table import Table

    law = Table(title="(a) Bandit: zero-variance rate vs p^N + (1-p)^N")
    for column in ("p", "N0 -> N_max", "measured", "predicted", "rollouts / group"):
        law.add_column(column, justify="right")
    for row in bandit_rows:
        law.add_row(
            f"{row['p']:.2f}",
            f"{row['N0']} -> {row['N_max']}",
            f"{row['measured']:.4f}",
            f"{row['predicted']:.4f}",
            f"{row['rollouts_per_group']:.2f}",
        )
    summary = Table(title=f"(b) Demo task, levels 1-5, equal rollout budget (SFT start {start:.1%} greedy)")
    for column in (
        "method",
        "final greedy (mean ± sd)",
        "per seed",
        "rollouts",
        "steps",
        "ZV sampled",
        "ZV expanded",
        "ZV final",
        "informative",
        "signal",
        "rollouts / signal group",
    ):
        summary.add_column(column, justify="right")
    for method in METHODS:
        runs = [r for r in results if r["method"] == method]
        if not runs:
            continue
        summary.add_row(
            method,
            *accuracy_cells(runs),
            f"{nan_mean([r['rollouts'] for r in runs]):.0f}",
            f"{nan_mean([r['steps'] for r in runs]):.0f}",
            f"{nan_mean([r['zero_variance']['sampled (N0)'] for r in runs]):.1%}",
            f"{nan_mean([r['zero_variance']['expanded'] for r in runs]):.1%}",
            f"{nan_mean([r['zero_variance']['final'] for r in runs]):.1%}",
            f"{nan_mean([r['informative_rollout_fraction'] for r in runs]):.1%}",
            f"{nan_mean([r['signal_rollout_fraction'] for r in runs]):.1%}",
            f"{nan_mean([r['rollouts_per_signal_group'] for r in runs]):.1f}",
        )
    return law, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--budget", type=int, default=12800, help="rollouts per run (GRPO: budget / 128 steps)"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument(
        "--evals", type=int, default=2, help="evaluations during each run (plus the final one)"
    )
    parser.add_argument("--workers", type=int, default=2, help="runs in parallel (1 thread each when > 1)")
    parser.add_argument("--sft-seed", type=int, default=1, help="seed of the shared SFT checkpoint")
    parser.add_argument("--tiny", action="store_true", help="smoke run on a 2-layer model in seconds")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    from rich.console import Console

    console = Console(width=150)
    started = time.perf_counter()
    bandit_rows = bandit(trials=200 if args.tiny else 4000)
    base = ["eval.num_samples=1", "eval.pass_k=1", "rl.levels=[1,2,3,4,5]"] + (TINY if args.tiny else [])
    if args.tiny:
        base += ["zve.filter.max_prompts=8"]
    work = args.out / "zve_runs"
    work.mkdir(parents=True, exist_ok=True)
    console.print("training the shared SFT checkpoint (or reusing it)...")
    sft_dir = prepare_sft([*base, f"seed={args.sft_seed}"], work / f"sft_seed{args.sft_seed}")
    start = start_evaluation(base, sft_dir, work)["greedy_accuracy"]
    per_step = 4 if args.tiny else 128  # GRPO's rollouts per step (prompts_per_step x group_size)
    grpo_steps = max(1, args.budget // per_step)
    every = max(1, grpo_steps // (args.evals + 1))
    fixed = [
        *base,
        f"model.path={sft_dir}",
        "sft.steps=0",
        f"rl.steps={4 * grpo_steps}",
        f"rl.max_rollouts={args.budget}",
        f"eval.every={every}",
        "checkpoint.every=0",
        "logging.progress=false",
        "logging.tensorboard=false",
    ]
    methods = {m: METHODS[m] for m in args.methods}
    if args.tiny:  # the tiny data set has fewer prompts than the filter's default sample
        methods = {m: [o for o in v if o != "zve.filter.max_prompts=400"] for m, v in methods.items()}
    console.print(
        f"{len(methods) * len(args.seeds)} runs of {args.budget} rollouts each, {args.workers} at a time"
    )
    cells = run_arms(methods, args.seeds, fixed, work, args.workers, console)
    results = [result_of(m, seed, run_dir, wall, start) for m, seed, run_dir, wall in cells]
    payload = {
        "benchmark": "zve",
        "sft_checkpoint": repo_path(sft_dir),
        "sft_greedy_accuracy": start,
        "budget": args.budget,
        "seeds": args.seeds,
        "methods": {m: METHODS[m] for m in args.methods},
        "tiny": args.tiny,
        "bandit": bandit_rows,
        "runs": results,
        "wall_seconds": time.perf_counter() - started,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_results(args.out / "zve.json", payload)
    plot(results, args.out / "zve.png")
    console.print(f"wrote {args.out / 'zve.json'} and {args.out / 'zve.png'}")
    for table in tables(bandit_rows, results, start):
        console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
