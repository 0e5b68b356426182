"""The RL step beside another busy process: how much slower it runs when something else takes one core.

    python -m bench.learner.contention --model models/smollm2-135m-instruct     # the smollm2 recipe, ~10 minutes
    python -m bench.learner.contention --smoke                                   # the tiny demo model, seconds

Arms, each `everyprompt train` in a process of its own, one after the other, in one run:
- quiet: nothing else running (the reference);
- loaded: beside `--load` processes that each spin one core's worth of pure Python for the whole arm,
  with the threads fitted to the free cores (`cpu_threads=adaptive`, the default);
- loaded, fixed threads: the same load with `cpu_threads=fixed` (what the project did before), for fewer
  steps (`--fixed-steps`: it is the slow one).
The figure is each loaded arm's mean RL step time (`time/step_s`) over the quiet arm's, on the same steps:
those at which the quiet arm ran on all its threads (one that fitted fewer found the machine busy, and is
left out, saying so: `compared_steps`).
Writes bench/results/contention.json (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import RESULTS, ROOT, repo_override, repo_path, write_results

TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_experts=4", "model.moe_intermediate_size=32",
        "model.num_heads=2", "model.num_kv_heads=1", "data.num_train=64", "data.num_eval=10", "sft.steps=0",
        "rl.prompts_per_step=2", "rl.group_size=2", "rollout.max_new_tokens=12", "eval.num_samples=0"]  # fmt: skip
SPIN = "while True: pass"


def _spinners(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", SPIN], start_new_session=True) for _ in range(count)]


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def arm(config: str, overrides: list[str], steps: int, load: int) -> dict:
    """One `everyprompt train` of `steps` RL steps beside `load` spinning processes: its step times."""
    with tempfile.TemporaryDirectory() as run_dir:
        spinning = _spinners(load)
        try:
            # a held-out split of 8 prompts: the evaluation after the steps is not what is measured
            command = [sys.executable, "-m", "everyprompt.cli", "train", config, *overrides, f"rl.steps={steps}",
                       "checkpoint.every=0", "eval.every=0", "data.num_eval=8", "--run-dir", run_dir]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        finally:
            _stop(spinning)
        if done.returncode:
            raise SystemExit(
                f"bench.learner.contention: the arm failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
            )
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {
        "load": load,
        "steps": len(rows),
        "step_s": [row["time/step_s"] for row in rows],
        "threads": [row.get("cpu/threads_rollout") for row in rows],
        "tokens_per_s": [row.get("rollout/tokens_per_s") for row in rows],
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def quiet_steps(quiet: dict) -> list[int]:
    """The steps of the quiet arm that ran on every thread the run started with: a step that fitted fewer
    found something else busy (another process on the machine), so it is no quiet reference and the
    ratio leaves it out, saying so. None left: the run is refused."""
    full = max((t for t in quiet["threads"] if t is not None), default=None)
    clean = [i for i, t in enumerate(quiet["threads"]) if t is None or t == full]
    disturbed = [i + 1 for i in range(len(quiet["threads"])) if i not in clean]
    if disturbed:
        print(f"bench.learner.contention: the quiet arm's step(s) {disturbed} ran on fewer threads (the "
              "machine was not quiet then); the ratio compares the other steps", flush=True)  # fmt: skip
    if not clean:
        raise SystemExit("bench.learner.contention: the quiet arm was disturbed at every step; run it alone")
    return clean


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="the recipe's model (default: the recipe's model.path)")
    parser.add_argument("--config", default=str(ROOT / "configs" / "smollm2.yaml"))
    parser.add_argument("--set", action="append", default=[], help="a config override (repeatable)")
    parser.add_argument("--steps", type=int, default=2, help="RL steps of the quiet and loaded arms")
    parser.add_argument(
        "--fixed-steps", type=int, default=1, help="RL steps of the fixed-threads arm (0: none)"
    )
    parser.add_argument("--load", type=int, default=1, help="spinning processes beside the loaded arms")
    parser.add_argument("--smoke", action="store_true", help="the tiny demo model, one step an arm")
    parser.add_argument("--out", type=Path, default=RESULTS / "contention.json")
    args = parser.parse_args(argv)
    config, overrides = args.config, list(args.set)
    if args.smoke:
        config, overrides, args.steps, args.fixed_steps = (
            "demo",
            [*TINY, "rl.max_staleness=0", *overrides],
            1,
            1,
        )
    elif args.model is not None:
        overrides.insert(0, f"model.path={args.model}")
    quiet = arm(config, overrides, args.steps, 0)
    print(f"quiet: {quiet['step_s']} s a step, threads {quiet['threads']}", flush=True)
    loaded = arm(config, overrides, args.steps, args.load)
    print(
        f"beside {args.load} busy process(es): {loaded['step_s']} s, threads {loaded['threads']}", flush=True
    )
    clean = quiet_steps(quiet)
    result = {
        "config": repo_path(config) if Path(config).is_file() else config,
        "overrides": [repo_override(o) for o in overrides],
        "cores": os.cpu_count(),
        "quiet": quiet,
        "loaded": loaded,
        "compared_steps": clean,  # the steps whose quiet arm ran on every thread (others were disturbed)
        "loaded_ratio": _mean([loaded["step_s"][i] for i in clean])
        / _mean([quiet["step_s"][i] for i in clean]),
    }
    if args.fixed_steps:
        fixed = arm(config, [*overrides, "cpu_threads=fixed"], args.fixed_steps, args.load)
        print(f"beside {args.load}, fixed threads: {fixed['step_s']} s", flush=True)
        result["loaded_fixed"] = fixed
        # the same steps where the quiet arm has them clean, else its clean steps' mean
        paired = [i for i in clean if i < fixed["steps"]]
        fixed_s = [fixed["step_s"][i] for i in paired] if paired else fixed["step_s"]
        quiet_s = [quiet["step_s"][i] for i in (paired or clean)]
        result["loaded_fixed_ratio"] = _mean(fixed_s) / _mean(quiet_s)
    out = write_results(args.out, result)
    fixed_said = f"; with fixed threads {result['loaded_fixed_ratio']:.2f}x" if args.fixed_steps else ""
    print(
        f"a step beside {args.load} busy process(es): {result['loaded_ratio']:.2f}x its quiet time{fixed_said}"
    )
    print(f"wrote {repo_path(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
