"""One C7 cell (arm, seed) in a process of its own: train for the budget with snapshots at the marks, then
evaluate every snapshot the same way for every arm (the smollm2 recipe's held-out prompts, greedy, its
math reward: `everyprompt eval`'s path), keep each snapshot's eval.json and completions and drop its
weights."""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import platform
import shutil
import sys
import time
from pathlib import Path

from bench.common import repo_path
from bench.evidence.run import QUIET
from bench.time_to_accuracy.arms import ARMS, MAX_STEPS, RECIPE, TRAINERS


def machine_id() -> str:
    """The card a cell ran on (its name and UUID), or the host's CPU: every arm of a seed must share it."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return f"{props.name} {getattr(props, 'uuid', '')} on {platform.node()}".strip()
    from everyprompt.run.machine import cpu_model

    return f"cpu {cpu_model()} on {platform.node()}"


def git_blob(path: Path) -> str:
    """The file's git blob id (`git hash-object`): which version of a recipe a record ran."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def arm_overrides(arm: str, overrides: list[str]) -> list[str]:
    """A cell's config overrides: the setup's, then the trainer's own (TRL as it ships: glibc's malloc
    defaults), then the clock's (no step count binds, no checkpoints or evaluations inside the budget)."""
    own = ["keep_freed_memory=false"] if ARMS[arm].trainer == "trl" else []
    return [*overrides, *own, *QUIET, f"rl.steps={MAX_STEPS}", "checkpoint.every=0", "eval.every=0"]


def run_cell(arm: str, seed: int, overrides: list[str], marks: list[float], out: str) -> dict:
    """Train arm `arm` with `seed` for `marks[-1]` seconds of its clock, evaluate its snapshots; its record."""
    import torch

    from everyprompt.config import load_config
    from everyprompt.pipeline.commands import evaluate_checkpoint

    started, out = time.perf_counter(), Path(out)
    config = load_config(ARMS[arm].config, [*arm_overrides(arm, overrides), f"seed={seed}"])
    trained = TRAINERS[ARMS[arm].trainer](config, out, marks)
    if len(trained["snapshots"]) < len(marks):
        raise RuntimeError(
            f"{arm}, seed {seed}: {MAX_STEPS} steps ended before its clock reached {marks[-1]} s"
        )
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    # every arm's snapshots evaluated alike: the shipped recipe's held-out prompts and evaluation settings
    judge = load_config(RECIPE, [*overrides, *QUIET, f"seed={seed}"])
    accuracy: dict[Path, float] = {}
    for snap in trained["snapshots"]:
        directory = snap["dir"]
        if directory not in accuracy:
            accuracy[directory] = evaluate_checkpoint(judge, directory, run_dir=directory / "eval")[
                "greedy_accuracy"
            ]
            for path in directory.iterdir():  # the weights go; eval.json and the completions stay
                if path.name != "eval":
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
    shutil.rmtree(out / "run" / "checkpoints", ignore_errors=True)
    last = trained["snapshots"][-1]
    return {
        "arm": arm,
        "seed": seed,
        "greedy_accuracy": accuracy[last["dir"]],
        "greedy_accuracy_by_seconds": {f"{s['mark_s']:g}": accuracy[s["dir"]] for s in trained["snapshots"]},
        "steps_by_seconds": {f"{s['mark_s']:g}": s["step"] for s in trained["snapshots"]},
        "rl_steps": trained["rl_steps"],
        "train_seconds": trained["train_seconds"],
        "step_s_median": trained["step_s_median"],
        "device": trained["device"],
        "machine": machine_id(),
        "config_blob": git_blob(ARMS[arm].config),
        "seconds": time.perf_counter() - started,
        "run_dir": repo_path(out),
    }


def evaluate_start(overrides: list[str], out: str) -> dict:
    """The starting model's held-out figure (every arm's mark 0), by the same evaluation."""
    from everyprompt.config import load_config
    from everyprompt.pipeline.commands import evaluate_checkpoint

    judge = load_config(RECIPE, [*overrides, *QUIET])
    results = evaluate_checkpoint(judge, judge.model.path, run_dir=Path(out))
    return {"greedy_accuracy": results["greedy_accuracy"], "machine": machine_id(), "run_dir": repo_path(out)}


def this_machine() -> dict:
    return {"machine": machine_id()}


PROBES = {"cell": run_cell, "start": evaluate_start, "machine": this_machine}


def main(argv: list[str] | None = None) -> int:
    """`--probe JSON`: [probe, *its arguments] (bench/common.py's run_probe); prints the probe's JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--probe", required=True)
    name, *arguments = json.loads(parser.parse_args(argv).probe)
    print(json.dumps(PROBES[name](*arguments), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
