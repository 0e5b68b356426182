"""The calculator tool on a real model: SmolLM2-135M-Instruct on products of two 2-digit numbers
(configs/smollm2-tools.yaml), with the calculator environment and without it, before and after RL.

Two arms on the same held-out questions: `tool` (the config as written: multi-turn episodes, the model may
call `<calc>...</calc>`) and `no_tool` (`env.name=null`: the same questions as single-turn chat prompts,
the same math reward). Each arm is evaluated once before RL and trained per seed, each run in its own
process and directory (bench/quality/smollm2.py's runner: a run cut short resumes, a finished one is read). The
results are written after every run, so a session cut short keeps what finished.

    make smollm2                                          # once: the model
    python -m bench.environments.tools --before-only                   # the held-out accuracy before RL, both arms
    python -m bench.environments.tools --seeds 0 1 2                   # and RL, 3 seeds per arm (~25 min a run here)

With the tool, each trained checkpoint is evaluated once more to count how often it calls the calculator.

Writes bench/results/tools.json (runs under bench/results/tools_runs/<arm>/).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.common import RESULTS, ROOT, repo_path, write_results
from bench.quality.smollm2 import before_rl, run_cli, seed_run

CONFIG = ROOT / "configs" / "smollm2-tools.yaml"
ARMS = {"tool": [], "no_tool": ["env.name=null"]}
CALL = "<calc>"


def arm_summary(before: dict, runs: dict[int, dict]) -> dict:
    """One arm's accuracy before RL and, per seed, after it (with the calculator's call counts where the
    run logged them)."""
    start = before["greedy_accuracy"]
    seeds = [
        {
            "seed": seed,
            "greedy_accuracy_after": run["results"]["greedy_accuracy"],
            "gain": run["results"]["greedy_accuracy"] - start,
            "rl_step_seconds": run["rl_step_seconds"],
            "run_dir": run["run_dir"],
        }
        for seed, run in sorted(runs.items())
    ]
    gains = [s["gain"] for s in seeds]
    return {
        "greedy_accuracy_before": start,
        "held_out_prompts": int(before["num_prompts"]),
        "seeds": seeds,
        "mean_gain": sum(gains) / len(gains) if gains else None,
        "mean_accuracy_after": sum(s["greedy_accuracy_after"] for s in seeds) / len(seeds) if seeds else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument(
        "--before-only", action="store_true", help="evaluate both arms before RL, no training"
    )
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of every run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    results = args.out / "tools.json"
    summary: dict = {"benchmark": "tools", "config": repo_path(CONFIG), "overrides": args.set, "arms": {}}
    befores = {}
    for arm, overrides in ARMS.items():
        work = args.out / "tools_runs" / arm
        work.mkdir(parents=True, exist_ok=True)
        befores[arm] = before_rl(work, [*overrides, *args.set], CONFIG)
        calls = call_fraction(work / "before_rl" / "completions.jsonl")
        print(
            f"{arm}: held-out greedy accuracy before RL {befores[arm]['greedy_accuracy']:.1%}, "
            f"{calls:.1%} of the completions call the calculator",
            flush=True,
        )
        summary["arms"][arm] = {**arm_summary(befores[arm], {}), "call_fraction_before": calls}
    write_results(results, summary)
    if not args.before_only:
        for seed in args.seeds:  # the arms alternate per seed: a session cut short leaves them even
            for arm, overrides in ARMS.items():
                work = args.out / "tools_runs" / arm
                run = seed_run(work, seed, [*overrides, *args.set], CONFIG)
                runs = {**_runs_of(summary["arms"][arm]), seed: run}
                summary["arms"][arm] = {**summary["arms"][arm], **arm_summary(befores[arm], runs)}
                if arm == "tool":  # how often the trained model calls (its checkpoint's greedy eval)
                    calls = calls_after(work, seed, [*overrides, *args.set])
                    summary["arms"][arm].setdefault("call_fraction_after", {})[str(seed)] = calls
                write_results(results, summary)
                print(f"{arm} seed {seed}: after RL {run['results']['greedy_accuracy']:.1%}", flush=True)
    print(f"wrote {repo_path(results)}")
    return 0


def calls_after(work: Path, seed: int, overrides: list[str]) -> float:
    """The call fraction of seed `seed`'s final checkpoint on the held-out questions (evaluated once)."""
    run = work / f"seed{seed}"
    step = json.loads((run / "eval.json").read_text())["step"]
    out = work / f"seed{seed}_eval"
    if not (out / "completions.jsonl").is_file():
        checkpoint = run / "checkpoints" / f"step_{step}"
        argv = ["eval", str(checkpoint), str(CONFIG), *overrides, "--run-dir", str(out)]
        run_cli(argv, work / f"seed{seed}_eval.log")
    return call_fraction(out / "completions.jsonl")


def call_fraction(completions: Path) -> float:
    """The share of an eval's greedy completions (completions.jsonl) that call the calculator."""
    rows = [json.loads(line) for line in completions.read_text().splitlines() if line.strip()]
    return sum(CALL in row["completion"] for row in rows) / len(rows) if rows else 0.0


def _runs_of(arm: dict) -> dict[int, dict]:
    """An arm summary's seeds back in seed_run's shape (what arm_summary reads)."""
    return {
        s["seed"]: {
            "results": {"greedy_accuracy": s["greedy_accuracy_after"]},
            "rl_step_seconds": s["rl_step_seconds"],
            "run_dir": s["run_dir"],
        }
        for s in arm["seeds"]
    }


if __name__ == "__main__":
    sys.exit(main())
