"""Ablation of the policy losses: GRPO, DAPO, GSPO and ESPO on the demo task.

Every method starts from the same SFT checkpoint and gets the same rollout budget (steps x prompts x
group size) under the same three seeds; only the loss (and its aggregation / clip settings) differs.

    python -m bench.quality.algorithms                 # the full ablation (~20 minutes on 2 CPU cores)
    python -m bench.quality.algorithms --steps 20      # shorter
    python -m bench.quality.algorithms --tiny          # seconds: a smoke run on a 2-layer model

The runs are the cells of one sweep (everyprompt.sweep, docs/sweeps.md) under
bench/results/algorithms_runs/sweep/: one process each, a progress display, and a killed benchmark
resumes the runs it finished. Writes bench/results/algorithms.json (per method and seed: held-out accuracy after each eval, clip
fractions, entropy, wall time) and bench/results/algorithms.png (accuracy vs rollouts); prints the
summary table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench.common import RESULTS, repo_path, write_results

# method -> config overrides (the rest is configs/demo.yaml)
METHODS: dict[str, list[str]] = {
    "GRPO": [
        "rl.loss=ppo_clip",
        "rl.ppo.clip_low=0.2",
        "rl.ppo.clip_high=0.2",
        "rl.loss_agg=seq-mean-token-mean",
    ],
    "DAPO": ["rl.loss=ppo_clip", "rl.ppo.clip_low=0.2", "rl.ppo.clip_high=0.28", "rl.loss_agg=token-mean"],
    "GSPO": ["rl.loss=gspo"],
    "ESPO": ["rl.loss=espo"],
}

TINY_MODEL = [  # a 2-layer MoE of 4 experts, hidden size 32
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_experts=4",
    "model.moe_intermediate_size=32",
    "model.num_heads=2",
    "model.num_kv_heads=1",
]
TINY = [
    *TINY_MODEL,
    "data.num_train=64",
    "data.num_eval=10",
    "sft.steps=4",
    "sft.batch_size=8",
    "rl.prompts_per_step=2",
    "rl.group_size=2",
    "rollout.max_new_tokens=12",
]


def nan_mean(values) -> float:
    """Mean of the values that are not NaN (NaN if none is)."""
    values = [v for v in values if v == v]
    return sum(values) / len(values) if values else float("nan")


def prepare_sft(base: list[str], out: Path) -> Path:
    """Train (or reuse) the shared SFT checkpoint and return its directory."""
    from everyprompt.config import load_config
    from everyprompt.pipeline import Run
    from everyprompt.run.layout import RunLayout

    sft_dir = RunLayout(out).sft_checkpoint
    if not (sft_dir / "config.json").is_file():
        config = load_config(None, [*base, "logging.progress=true", "logging.tensorboard=false"])
        Run(config, out).warm_started_model()
    return sft_dir


def run_arms(
    arms: dict[str, list[str]], seeds: list[int], fixed: list[str], work: Path, workers: int, console
) -> list[tuple[str, int, Path, float]]:
    """Every (arm, seed) as a cell of one sweep under `work/sweep` (`everyprompt.sweep`: a process per run,
    `workers` at a time, a progress display; a killed benchmark resumes its finished runs). Returns
    (arm, seed, run directory, wall seconds) per cell; a failed run stops the benchmark, naming its log."""
    import shutil

    from everyprompt.config import demo_config_path, read_yaml
    from everyprompt.sweep import SweepPlan, SweepRunner

    plan = SweepPlan(read_yaml(demo_config_path()), fixed, {}, seeds, str(demo_config_path()), arms)
    plan.validate()
    sweep_dir = work / "sweep"
    if (sweep_dir / "sweep.json").is_file() and SweepPlan.load(sweep_dir).same_as(plan):
        shutil.rmtree(sweep_dir)  # a run of other settings: start over
    plan.save(sweep_dir)
    outcomes = SweepRunner(plan, sweep_dir, workers, console).run()
    failed = [name for name, outcome in outcomes.items() if outcome.state == "failed"]
    if failed:
        raise SystemExit(f"runs failed: {', '.join(failed)} (their output.log in {sweep_dir} says why)")
    return [(c.arm, c.seed, sweep_dir / c.name, outcomes[c.name].seconds) for c in plan.cells()]


def records_of(run_dir: Path) -> tuple[list[dict], dict]:
    """A finished run's per-step records (metrics.jsonl) and its final held-out evaluation (eval.json)."""
    from everyprompt.report import load_metrics

    final = json.loads((run_dir / "eval.json").read_text())
    return load_metrics(run_dir / "metrics.jsonl").records, final


def start_evaluation(base: list[str], sft_dir: Path, work: Path) -> dict:
    """Held-out evaluation of the shared SFT checkpoint (cached beside it): every run's step 0."""
    cache = sft_dir.parent.parent / "start_eval.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    from everyprompt.config import load_config
    from everyprompt.models.io import load_pretrained
    from everyprompt.pipeline import Run
    from everyprompt.rollout import build_engine

    config = load_config(None, [*base, "logging.progress=false"])
    run = Run(config, work / "start_eval")
    model, tokenizer = load_pretrained(sft_dir)
    result = run.evaluate(build_engine(config.rollout, model, tokenizer), tokenizer)
    cache.write_text(json.dumps(result))
    return result


def accuracy_cells(runs: list[dict]) -> tuple[str, str]:
    """('mean ± sd', 'per seed') of the runs' final greedy accuracies, for summary tables."""
    finals = [r["final_greedy_accuracy"] for r in runs]
    sd = statistics.stdev(finals) if len(finals) > 1 else 0.0
    return f"{nan_mean(finals):.1%} ± {sd:.1%}", " ".join(f"{f:.1%}" for f in finals)


def result_of(
    method: str, seed: int, run_dir: Path, wall: float, rollouts_per_step: int, start: dict
) -> dict:
    """One run's figures, from the files it wrote."""
    history, final = records_of(run_dir)
    evals = [{"step": 0, "rollouts": 0, **_eval_fields(start)}]
    for metrics in history:
        if "eval/greedy_accuracy" in metrics:
            fields = {k.removeprefix("eval/"): v for k, v in metrics.items() if k.startswith("eval/")}
            step = metrics["step"]
            evals.append({"step": step, "rollouts": step * rollouts_per_step, **_eval_fields(fields)})
    evals.append({"step": len(history), "rollouts": len(history) * rollouts_per_step, **_eval_fields(final)})
    per_step = {
        key: [m.get(key, float("nan")) for m in history]
        for key in sorted({k for m in history for k in m})
        if key.startswith(("actor/", "espo/", "reward/"))
    }
    # the policy's entropy is measured by updates: steps without signal (no update) have none
    entropies = [v for v in per_step.get("actor/entropy", []) if v == v] or [float("nan")]
    return {
        "method": method,
        "seed": seed,
        "evals": evals,
        "final_greedy_accuracy": final["greedy_accuracy"],
        "clip_fraction_mean": nan_mean(per_step.get("actor/clip_fraction", [])),
        "entropy_first": entropies[0],
        "entropy_last": entropies[-1],
        "reward_mean": nan_mean(per_step.get("reward/mean", [])),
        "espo": {key: nan_mean(values) for key, values in per_step.items() if key.startswith("espo/")},
        "per_step": per_step,
        "wall_seconds": wall,
        "run_dir": repo_path(run_dir),
    }


def _eval_fields(evaluation: dict) -> dict:
    return {
        "greedy_accuracy": evaluation["greedy_accuracy"],
        "pass@1": evaluation.get("pass@1", float("nan")),
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = dict(zip(METHODS, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    for method in METHODS:
        runs = [r for r in results if r["method"] == method]
        for index, run in enumerate(runs):
            xs = [e["rollouts"] for e in run["evals"]]
            ys = [100 * e["greedy_accuracy"] for e in run["evals"]]
            ax.plot(
                xs,
                ys,
                color=colours[method],
                alpha=0.8,
                marker="o",
                ms=3,
                label=method if index == 0 else None,
            )
    ax.set_xlabel("rollouts (completions sampled)")
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.set_title("Policy losses from one SFT checkpoint (3 seeds each)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary_table(results: list[dict], start: float):
    from rich.table import Table

    table = Table(title=f"Policy-loss ablation (SFT start: {start:.1%} greedy)")
    for column in (
        "method",
        "final greedy (mean ± sd)",
        "per seed",
        "change",
        "clip frac",
        "entropy",
        "wall s",
    ):
        table.add_column(column, justify="right")
    for method in METHODS:
        runs = [r for r in results if r["method"] == method]
        if not runs:
            continue
        finals = [r["final_greedy_accuracy"] for r in runs]
        table.add_row(
            method,
            *accuracy_cells(runs),
            f"{(nan_mean(finals) - start) * 100:+.1f} pt",
            f"{nan_mean([r['clip_fraction_mean'] for r in runs]):.4f}",
            f"{nan_mean([r['entropy_first'] for r in runs]):.3f}→{nan_mean([r['entropy_last'] for r in runs]):.3f}",
            f"{nan_mean([r['wall_seconds'] for r in runs]):.0f}",
        )
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60, help="RL steps per run (the rollout budget)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument(
        "--evals", type=int, default=3, help="evaluations during each run (plus the final one)"
    )
    parser.add_argument("--workers", type=int, default=2, help="runs in parallel (1 thread each when > 1)")
    parser.add_argument(
        "--sft-seed", type=int, default=1, help="seed of the shared SFT checkpoint (1: the most RL headroom)"
    )
    parser.add_argument("--tiny", action="store_true", help="smoke run on a 2-layer model in seconds")
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides of every RL run"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    from rich.console import Console

    console = Console(width=110)
    base = ["eval.num_samples=1", "eval.pass_k=1"] + (TINY if args.tiny else [])
    out = args.out
    work = out / "algorithms_runs"
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    console.print("training the shared SFT checkpoint (or reusing it)...")
    sft_dir = prepare_sft([*base, f"seed={args.sft_seed}"], work / f"sft_seed{args.sft_seed}")
    every = max(1, args.steps // (args.evals + 1))
    fixed = [
        *base,
        f"model.path={sft_dir}",
        "sft.steps=0",
        f"rl.steps={args.steps}",
        f"eval.every={every}",
        "checkpoint.every=0",
        "logging.progress=false",
        "logging.tensorboard=false",
        *args.set,
    ]
    console.print(
        f"{len(args.methods) * len(args.seeds)} runs of {args.steps} steps, {args.workers} at a time"
    )
    start_eval = start_evaluation(base, sft_dir, work)
    cells = run_arms({m: METHODS[m] for m in args.methods}, args.seeds, fixed, work, args.workers, console)
    from everyprompt.config import load_config

    config = load_config(None, fixed)
    rollouts_per_step = config.rl.prompts_per_step * config.rl.group_size
    results = [result_of(m, seed, d, wall, rollouts_per_step, start_eval) for m, seed, d, wall in cells]
    start = start_eval["greedy_accuracy"]
    payload = {
        "benchmark": "algorithms",
        "sft_checkpoint": repo_path(sft_dir),
        "sft_seed": args.sft_seed,
        "steps": args.steps,
        "seeds": args.seeds,
        "methods": {m: METHODS[m] for m in args.methods},
        "tiny": args.tiny,
        "sft_greedy_accuracy": start,
        "wall_seconds": time.perf_counter() - started,
        "runs": results,
    }
    out.mkdir(parents=True, exist_ok=True)
    write_results(out / "algorithms.json", payload)
    plot(results, out / "algorithms.png")
    console.print(f"wrote {out / 'algorithms.json'} and {out / 'algorithms.png'}")
    console.print(summary_table(results, start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
