"""Asynchronous training on this machine: the demo's RL phase synchronous and with rl.max_staleness 1 and
2, from the same SFT checkpoint, at equal RL steps, over several seeds.

Every set-up runs in a fresh process with torch pinned to one intra-op thread (`threads=1`): the
synchronous loop then runs rollout and update one after the other on one core, an asynchronous run
its rollout thread and its learner thread side by side, one core each (this machine has 2). Also
measured, as context: the synchronous loop with 2 threads, both cores on each phase.

Reported per set-up (medians over the steps after the first two, then over seeds): the RL step time and
its ratio to the synchronous one-thread reference, the rollout and update times, the learner's and
the rollout side's idle fractions (waiting for a batch / for weights, over the step), the staleness,
the sequences per step that spanned a weight update (partial rollouts, `rollout.partial_tokens` = half
the cap) and the engine's prefill time (what re-prefilling continued sequences costs);
and the held-out greedy accuracy and pass@k after the last step, per seed, with their mean and spread.

    python -m bench.distributed.async             # ~20 minutes on 2 CPU cores
    python -m bench.distributed.async --tiny      # ~3 minutes: one seed, few steps, short SFT

Writes bench/results/async.json.
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

DECOUPLED = ["rl.old_logprobs=recompute", "rl.rollout_correction.mode=tis"]
# the synchronous loop as the demo ran it before asynchrony was its default: the engine's log-probs as
# the old policy's (both fp32), no correction
SYNC = ["rl.max_staleness=0", "rl.old_logprobs=rollout", "rl.rollout_correction.mode=null"]
SETUPS = {
    "sync, 1 thread": ["threads=1", *SYNC],
    "sync, 2 threads": ["threads=2", *SYNC],
    "sync + decoupled loss, 1 thread": ["threads=1", "rl.max_staleness=0", *DECOUPLED],
    "async k=1": ["threads=1", "rl.max_staleness=1", *DECOUPLED],
    "async k=2": ["threads=1", "rl.max_staleness=2", *DECOUPLED],
    "async k=1 + partial": ["threads=1", "rl.max_staleness=1", *DECOUPLED, "rollout.partial=true"],
    "async k=2 + partial": ["threads=1", "rl.max_staleness=2", *DECOUPLED, "rollout.partial=true"],
}
REFERENCE = "sync, 1 thread"
RUN = ["sft.steps=0", "logging.progress=false", "checkpoint.every=0"]
SKIP = 2  # the first steps: warm-up, and an asynchronous run's first batch has nothing to overlap


def make_sft(directory: Path, steps: int) -> Path:
    """The demo's SFT warm start, `steps` steps: the checkpoint every set-up starts RL from."""
    from everyprompt.config import load_config
    from everyprompt.pipeline import Run

    run = Run(load_config(DEMO, [f"sft.steps={steps}", "logging.progress=false"]), directory)
    run.warm_started_model()
    return directory / "checkpoints" / "sft"


def _idle(row: dict) -> tuple[float, float]:
    """(learner idle, rollout idle) as fractions of the step: asynchronous runs measure their waits; in the
    synchronous loop each side idles while the other works."""
    step = row["time/step_s"]
    if "async/learner_wait_s" in row:
        return row["async/learner_wait_s"] / step, row["async/rollout_wait_s"] / step
    return row["time/rollout_s"] / step, row["time/train_s"] / step


def measure(overrides: list[str], checkpoint: str, steps: int, seed: int, num_eval: int) -> dict:
    """One set-up and seed (run in a process of its own: see `main`)."""
    from everyprompt.config import load_config
    from everyprompt.pipeline import train

    config = load_config(
        DEMO,
        [
            *RUN,
            f"model.path={checkpoint}",
            f"rl.steps={steps}",
            f"seed={seed}",
            f"data.num_eval={num_eval}",
            *overrides,
        ],
    )
    with tempfile.TemporaryDirectory() as run_dir:
        train(config, run_dir=run_dir)
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").open()]
        final = json.loads((Path(run_dir) / "eval.json").read_text())
    timed = rows[SKIP:] or rows
    idle = [_idle(row) for row in timed]
    median = lambda key: statistics.median(row.get(key, 0.0) for row in timed)  # noqa: E731
    return {
        "step_s": median("time/step_s"),
        "rollout_s": median("time/rollout_s"),
        "train_s": median("time/train_s"),
        "learner_idle": statistics.median(i for i, _ in idle),
        "rollout_idle": statistics.median(r for _, r in idle),
        "staleness_mean": statistics.fmean(row.get("async/staleness_mean", 0.0) for row in rows),
        "staleness_max": max(row.get("async/staleness_max", 0.0) for row in rows),
        "partial_sequences_per_step": statistics.fmean(
            row.get("async/partial_sequences", 0.0) for row in rows
        ),
        "prefill_s": median("rollout/prefill_s"),
        "reward_mean_last10": statistics.fmean(row["reward/mean"] for row in rows[-10:]),
        "greedy_accuracy": final["greedy_accuracy"],
        "pass_at_k": final[f"pass@{config.eval.pass_k}"],
    }


def summarize(per_seed: dict[int, dict]) -> dict:
    """Medians of the timings over seeds; the accuracy per seed with its mean and spread (max - min)."""
    runs = list(per_seed.values())
    out = {
        key: statistics.median(r[key] for r in runs)
        for key in runs[0]
        if key not in ("greedy_accuracy", "pass_at_k")
    }
    for key in ("greedy_accuracy", "pass_at_k"):
        values = [r[key] for r in runs]
        out[key] = {"per_seed": values, "mean": statistics.fmean(values), "spread": max(values) - min(values)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sft-steps", type=int, default=480)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--num-eval", type=int, default=300)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure this set-up, print JSON
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tiny:
        args.steps, args.sft_steps, args.seeds, args.num_eval = 6, 120, [0], 50
    if args.one is not None:
        name = args.one.rsplit("|", 1)[0]
        print(json.dumps(measure(SETUPS[name], args.checkpoint, args.steps, args.seed, args.num_eval)))
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = make_sft(Path(scratch) / "sft", args.sft_steps)
        per_seed: dict[str, dict[int, dict]] = {name: {} for name in args.setups}
        for seed in args.seeds:
            extra = ["--checkpoint", str(checkpoint), "--steps", str(args.steps), "--seed", str(seed)]
            extra += ["--num-eval", str(args.num_eval)]
            results = measure_each(__file__, [f"{name}|{seed}" for name in args.setups], extra)
            for key, figures in results.items():
                per_seed[key.rsplit("|", 1)[0]][seed] = figures
    results = {name: {**summarize(runs), "seeds": runs} for name, runs in per_seed.items()}
    reference = results.get(REFERENCE) or results[args.setups[0]]
    for figures in results.values():
        figures["speedup_vs_reference"] = reference["step_s"] / figures["step_s"]
    payload = {
        "config": str(DEMO.relative_to(ROOT)),
        "sft_steps": args.sft_steps,
        "rl_steps": args.steps,
        "seeds": args.seeds,
        "held_out_prompts": args.num_eval,
        "reference": REFERENCE,
        "setups": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_results(args.out / "async.json", payload)
    print(
        f"{'set-up':32} {'step s':>7} {'speedup':>7} {'rollout':>7} {'update':>7} {'L idle':>6} "
        f"{'R idle':>6} {'stale':>5} {'greedy (spread)':>16} {'pass@k':>7}"
    )
    for name, f in results.items():
        greedy, passk = f["greedy_accuracy"], f["pass_at_k"]
        print(
            f"{name:32} {f['step_s']:7.2f} {f['speedup_vs_reference']:7.2f} {f['rollout_s']:7.2f} "
            f"{f['train_s']:7.2f} {f['learner_idle']:6.0%} {f['rollout_idle']:6.0%} {f['staleness_mean']:5.2f} "
            f"{greedy['mean']:8.1%} ({greedy['spread']:4.1%}) {passk['mean']:7.1%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
