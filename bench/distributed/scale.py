"""Scale-out on this machine: the RL step of the demo with 1 or 2 rollout workers and 1 or 2 learner ranks
on a local Ray instance, against the local backend (one process) in the same run.

Every set-up trains the demo's RL phase (configs/demo.yaml) from the same SFT checkpoint, made once at
the start (`--sft-steps` steps), for `--steps` RL steps in a fresh process; each actor is pinned to one
torch thread (`cluster.num_cpus=1`), and the local backend is measured with 1 thread and with 2 (this
machine's cores). Reported per set-up, medians over the steps after the first: the RL step time, the
rollout phase (generation and scoring) and its tokens/s, the learner's update, the weight sync, and the
bytes synced. Ratios are against the local backend with one thread. From the one-thread figures the
script also projects the step time of larger set-ups (docs/cluster.md): rollout and update divided over
workers and ranks, the weight sync and Ray's per-step overhead kept as measured.

    python -m bench.distributed.scale               # ~6 minutes on 2 CPU cores
    python -m bench.distributed.scale --tiny        # ~2 minutes: fewer steps, shorter SFT

Writes bench/results/scale.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench.common import RESULTS, ROOT, write_results
from bench.setups import measure_each  # bench/setups.py

DEMO = ROOT / "configs" / "demo.yaml"

ONE_THREAD = ["cluster.num_cpus=1", "cluster.num_gpus=0"]
SETUPS = {
    "local, 1 thread": ["threads=1"],
    "local, 2 threads": ["threads=2"],
    "ray: 1 worker, 1 rank": ["cluster.backend=ray", "threads=1", *ONE_THREAD],
    "ray: 2 workers, 1 rank": ["cluster.backend=ray", "threads=1", "cluster.rollout_workers=2", *ONE_THREAD],
    "ray: 1 worker, 2 ranks": ["cluster.backend=ray", "threads=1", "cluster.trainer_ranks=2", *ONE_THREAD],
    "ray: 2 workers, 2 ranks": [
        "cluster.backend=ray",
        "threads=1",
        "cluster.rollout_workers=2",
        "cluster.trainer_ranks=2",
        *ONE_THREAD,
    ],
}
REFERENCE = "local, 1 thread"
# quick evaluation: the held-out figures are not what is measured here
RUN = ["sft.steps=0", "data.num_eval=8", "eval.num_samples=1", "eval.pass_k=1", "logging.progress=false"]
FIGURES = {
    "step_s": "time/step_s",
    "rollout_s": "time/rollout_s",
    "train_s": "time/train_s",
    "weight_sync_s": "time/weight_sync_s",
    "tokens_per_s": "rollout/tokens_per_s",
    "sync_bytes": "sync/bytes",
    "tokens": "rollout/tokens",
}


def make_sft(directory: Path, steps: int) -> Path:
    """The demo's SFT warm start, `steps` steps: the checkpoint every set-up starts RL from."""
    from everyprompt.config import load_config
    from everyprompt.pipeline import Run

    run = Run(load_config(DEMO, [f"sft.steps={steps}", "logging.progress=false"]), directory)
    run.warm_started_model()
    return directory / "checkpoints" / "sft"


def measure(overrides: list[str], checkpoint: str, steps: int) -> dict:
    """One set-up's medians over its steps after the first (run in a process of its own: see `main`)."""
    from everyprompt.config import load_config
    from everyprompt.pipeline import train

    config = load_config(DEMO, [*RUN, f"model.path={checkpoint}", f"rl.steps={steps}", *overrides])
    with tempfile.TemporaryDirectory() as run_dir:
        train(config, run_dir=run_dir)
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").open()][1:]
    return {name: statistics.median(row[key] for row in rows) for name, key in FIGURES.items()}


def project(base: dict, ray_one: dict, workers: int, ranks: int) -> float:
    """A step of `workers` rollout workers and `ranks` learner ranks from the one-thread figures: rollout
    and update divide, the weight sync and Ray's overhead per step (1 worker + 1 rank vs one process)
    stay. An estimate of what more machines give, not a measurement."""
    overhead = max(ray_one["step_s"] - base["step_s"], 0.0)
    return base["rollout_s"] / workers + base["train_s"] / ranks + ray_one["weight_sync_s"] + overhead


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--sft-steps", type=int, default=240)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure this set-up, print JSON
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps, sft_steps = (3, 120) if args.tiny else (args.steps, args.sft_steps)
    if args.one is not None:
        print(json.dumps(measure(SETUPS[args.one], args.checkpoint, steps)))
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = make_sft(Path(scratch) / "sft", sft_steps)
        extra = ["--checkpoint", str(checkpoint), "--steps", str(steps)]
        results = measure_each(__file__, args.setups, extra)
    reference = results.get(REFERENCE) or results[args.setups[0]]
    for figures in results.values():
        figures["step_vs_reference"] = figures["step_s"] / reference["step_s"]
        figures["tokens_per_s_vs_reference"] = figures["tokens_per_s"] / reference["tokens_per_s"]
    payload = {
        "config": str(DEMO.relative_to(ROOT)),
        "sft_steps": sft_steps,
        "rl_steps": steps,
        "reference": REFERENCE,
        "setups": results,
    }
    ray_one = results.get("ray: 1 worker, 1 rank")
    if REFERENCE in results and ray_one is not None:
        payload["ray_overhead_s"] = ray_one["step_s"] - reference["step_s"]
        payload["projection_step_s"] = {
            f"{w} workers, {r} ranks": project(reference, ray_one, w, r) for w, r in [(2, 2), (4, 4), (8, 8)]
        }
    args.out.mkdir(parents=True, exist_ok=True)
    write_results(args.out / "scale.json", payload)
    print(
        f"{'set-up':26} {'step s':>7} {'vs ref':>7} {'rollout s':>9} {'tok/s':>7} {'vs ref':>7} "
        f"{'train s':>8} {'sync s':>7} {'sync MB':>8}"
    )
    for name, f in results.items():
        print(
            f"{name:26} {f['step_s']:7.2f} {f['step_vs_reference']:7.2f} {f['rollout_s']:9.2f} "
            f"{f['tokens_per_s']:7.0f} {f['tokens_per_s_vs_reference']:7.2f} {f['train_s']:8.2f} "
            f"{f['weight_sync_s']:7.3f} {f['sync_bytes'] / 1e6:8.2f}"
        )
    if "ray_overhead_s" in payload:
        print(
            f"Ray's overhead per step (1 worker + 1 rank vs one process, 1 thread): {payload['ray_overhead_s']:.2f} s"
        )
        for name, value in payload["projection_step_s"].items():
            print(f"projected step, {name}: {value:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
