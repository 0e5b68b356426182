"""One RL step on a real model: everyprompt against TRL's GRPOTrainer on the same model, prompts, group
size, completion cap, learning rate and precision (the recipe `--config`, configs/smollm2.yaml by default,
with `model.path=--model`), split by phase, with each trainer's peak resident memory.

Each trainer runs in a process of its own (`--steps` steps, the first dropped as warm-up); its memory is
that process's peak resident set (`ru_maxrss`), model loading included. TRL comes with the `bench` extra
(`pip install -e .[bench]`).

    python -m bench.learner.rl_step --model models/smollm2-135m-instruct          # ~10 minutes on 2 cores
    python -m bench.learner.rl_step --model models/smollm2-135m-instruct --set rl.group_size=4
    python -m bench.learner.rl_step --model models/smollm2-135m-instruct --set rl.group_size=16 --set malloc=tcmalloc \
        --tag group16_tcmalloc      # everyprompt on tcmalloc (TRL on glibc's, as it ships)

Writes bench/results/rl_step_<model>[_<tag>].json.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from bench.common import parse_probing, recipe_parser, repo_path, run_probe, write_results
from everyprompt.devices.malloc import preloaded_environment, running_malloc, wanted_malloc
from everyprompt.devices.memory import peak_resident_bytes


def probe(trainer: str, config: str, overrides: list[str], steps: int, run_dir: str, matched: bool) -> dict:
    """One trainer's steps in this process, with its peak resident set."""
    from bench.throughput.rl import everyprompt_steps, trl_steps

    if trainer == "everyprompt":
        result = everyprompt_steps(overrides, steps, Path(run_dir), Path(config))
    else:
        result = trl_steps(overrides, steps, Path(run_dir), Path(config), matched=matched)
    result["peak_rss_bytes"] = peak_resident_bytes()
    result["malloc"] = running_malloc()
    return result


def bench_overrides(model: Path, extra: list[str]) -> list[str]:
    """The recipe's overrides for a benchmark step: the model, quiet logs, no held-out evaluation."""
    quiet = ["logging.progress=false", "logging.tensorboard=false", "data.num_eval=1", "eval.every=0"]
    return [f"model.path={model}", *quiet, *extra]


def measure(
    trainer: str,
    config: Path,
    overrides: list[str],
    steps: int,
    trl_allocator: str = "default",
    trl_micro_batch: str = "matched",
    rollout_precision: str = "matched",
) -> dict:
    """One trainer's figures from a process of its own. TRL as it ships: glibc's allocator defaults
    (everyprompt's own `keep_freed_memory` speeds it up too; `trl_allocator="kept"` measures that), with
    the recipe's micro-batch size (`trl_micro_batch="step"`: all of a mini-batch in one micro-batch);
    everyprompt decoding in TRL's arithmetic (`matched_precision`; `rollout_precision="recipe"`: the
    recipe's own)."""
    if trainer == "trl" and trl_allocator == "default":
        overrides = [*overrides, "keep_freed_memory=false"]
    if trainer == "everyprompt" and rollout_precision == "matched":
        overrides = [*overrides, *matched_precision(config, overrides)]
    matched = trl_micro_batch == "matched"
    # everyprompt's process on the malloc its config names, as the everyprompt command would start it;
    # TRL's on glibc's, as it ships
    env = None
    if trainer == "everyprompt":
        from everyprompt.config import load_config

        env = preloaded_environment(wanted_malloc(load_config(config, overrides).malloc))
    with tempfile.TemporaryDirectory() as run_dir:
        arguments = [trainer, str(config), overrides, steps, run_dir, matched]
        return run_probe(__file__, "--probe", arguments, env=env)


def matched_precision(config: Path, overrides: list[str]) -> list[str]:
    """everyprompt's overrides for the arithmetic TRL decodes in: TRL trains a bf16 recipe under
    accelerate's autocast, which wraps the forward its `generate` calls, so it samples with bf16 matrix
    products; everyprompt's engine then decodes in bf16 too, and the old policy's log-probs come from the
    learner's own first forward (rl.old_logprobs=recompute: no extra pass with one mini-batch)."""
    from everyprompt.config import load_config

    if load_config(config, overrides).model.dtype != "bf16":
        return []
    return ["rollout.precision=bf16", "rl.old_logprobs=recompute"]


def main(argv: list[str] | None = None) -> int:
    parser = recipe_parser(__doc__)
    parser.add_argument("--steps", type=int, default=4, help="steps per trainer (the first is dropped)")
    parser.add_argument("--trainers", default="everyprompt,trl")
    parser.add_argument(
        "--trl-allocator",
        choices=["default", "kept"],
        default="default",
        help="TRL's process with glibc's malloc defaults (as it ships) or with everyprompt's keep_freed_memory",
    )
    parser.add_argument(
        "--trl-micro-batch",
        choices=["matched", "step"],
        default="matched",
        help="TRL's micro-batch: the recipe's rl.micro_batch_size with gradient accumulation (matched), or "
        "a whole mini-batch at once (step)",
    )
    parser.add_argument(
        "--rollout-precision",
        choices=["matched", "recipe"],
        default="matched",
        help="everyprompt's engine arithmetic: TRL's (matched: a recipe trained in bf16 decodes in bf16, "
        "as TRL's generate runs under the same autocast) or the recipe's own rollout.precision",
    )
    parser.add_argument(
        "--tag", default="", help="appended to the results' file name (rl_step_<model>_<tag>)"
    )
    args = parse_probing(parser, argv, probe)
    if args is None:
        return 0
    overrides = bench_overrides(args.model, args.set)
    started = time.perf_counter()
    results: dict = {"benchmark": "rl_step", "model": repo_path(args.model), "config": repo_path(args.config)}
    results["overrides"] = args.set
    kept = args.trl_allocator == "kept"
    results["trl_allocator"] = "everyprompt's keep_freed_memory" if kept else "glibc defaults"
    results["trl_micro_batch"] = args.trl_micro_batch
    matched = args.rollout_precision == "matched"
    results["rollout_precision"] = args.rollout_precision
    results["everyprompt_overrides"] = matched_precision(args.config, overrides) if matched else []
    name = args.model.name.removesuffix(".gguf")
    suffix = (
        ("_trl_allocator_kept" if kept else "")
        + ("_trl_whole_batch" if args.trl_micro_batch == "step" else "")
        + ("_rollout_as_recipe" if args.rollout_precision == "recipe" else "")
        + (f"_{args.tag}" if args.tag else "")
    )
    path = args.out / f"rl_step_{name}{suffix}.json"
    for trainer in args.trainers.split(","):
        print(f"{trainer}: {args.steps} steps ...", flush=True)
        results[trainer] = measure(
            trainer,
            args.config,
            overrides,
            args.steps,
            args.trl_allocator,
            args.trl_micro_batch,
            args.rollout_precision,
        )
        print(f"  {describe(results[trainer])}", flush=True)
        results["wall_seconds"] = time.perf_counter() - started
        # each trainer's figures kept as they come (a time limit may stop the next)
        write_results(path, results)
    if "everyprompt" in results and "trl" in results:
        ours, theirs = results["everyprompt"], results["trl"]
        results["step_ratio"] = ours["step_s"] / theirs["step_s"]
        results["memory_ratio"] = ours["peak_rss_bytes"] / theirs["peak_rss_bytes"]
        print(
            f"everyprompt / TRL: {results['step_ratio']:.2f}x the time, {results['memory_ratio']:.2f}x the memory"
        )
    results["wall_seconds"] = time.perf_counter() - started
    out = write_results(path, results)
    print(f"wrote {repo_path(out)}")
    return 0


def describe(row: dict) -> str:
    """A trainer's step in a line: its median and memory, then where its time went: every phase and engine
    figure the trainer reports (everyprompt's `medians`), else the phases it was timed by (TRL's)."""
    line = f"{row['step_s']:.2f} s a step, peak {row['peak_rss_bytes'] / 2**30:.2f} GiB"
    figures = row.get("medians")
    if not figures and isinstance(row.get("generate_s"), float):
        figures = {"generate_s": row["generate_s"]}
    line += "".join(f"\n    {key}: {value:.4g}" for key, value in sorted((figures or {}).items()))
    if "graph_eager_steps_by_step" in row:  # everyprompt's engine: graphs in every step after the first?
        line += (
            f"\n    decode phases without their graph, by step: {row['graph_eager_steps_by_step']}; capture "
            f"refused: {bool(row['graph_failed'])}; largest trusted replay difference: "
            f"{row['graph_replay_eps']:.3g} epsilons"
        )
    return line


if __name__ == "__main__":
    sys.exit(main())
