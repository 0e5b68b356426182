"""Chaos: kill training runs with SIGKILL at random instants, resume them, compare with an uninterrupted run.

Each run is a short config (SFT warm start with checkpoints, RL with zero-variance elimination and two
reward worker processes) started as `everyprompt train` in its own process. It is killed with SIGKILL at a
random instant of a chosen phase (SFT, RL, or while an SFT or RL checkpoint is being written: the moment
its temporary directory appears); every third run is killed a second time during its resume. Each kill
records what the run had done (SFT and RL steps logged, a checkpoint being written) and how many child
processes it had. Then
`everyprompt train --resume` runs it to the end. Reported per run: whether it finished, the largest
|parameter difference| of its final model to the uninterrupted run's, and how many of the killed
processes' children were still alive 5 s after each kill.

    python -m bench.distributed.chaos --runs 10        # ~10 minutes on 2 CPU cores

Writes bench/results/chaos.json and prints the table.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.common import RESULTS, ROOT, write_results
from bench.quality.algorithms import TINY
from everyprompt.processes import descendants, is_alive

CONFIG = [
    *TINY,
    "data.num_train=2000",  # 40 RL steps with retirement need more prompts than the tiny set's 64
    "sft.steps=200",
    "sft.checkpoint_every=20",
    "rl.steps=40",
    "checkpoint.every=5",
    "zve.enabled=true",
    "zve.expansion.max_group_size=4",
    "rewards.workers=2",
    "rewards.function=math",
    "logging.progress=false",
    "logging.tensorboard=false",
]
PHASES = ("sft", "rl", "sft_checkpoint", "rl_checkpoint")  # a checkpoint phase: while one is written
WRITING = {"sft_checkpoint": ".tmp-sft_step_", "rl_checkpoint": ".tmp-step_"}


def _command(run_dir: Path, resume: bool) -> list[str]:
    if resume:
        return [sys.executable, "-m", "everyprompt.cli", "train", "--resume", str(run_dir)]
    return [sys.executable, "-m", "everyprompt.cli", "train", *CONFIG, "--run-dir", str(run_dir)]


def _start(run_dir: Path, resume: bool) -> subprocess.Popen:
    log = open(run_dir.parent / f"{run_dir.name}.log", "a")  # noqa: SIM115  (closed with the process)
    return subprocess.Popen(_command(run_dir, resume), stdout=log, stderr=log, cwd=ROOT)


def _lines(path: Path) -> int:
    return path.read_text().count("\n") if path.is_file() else 0


def _writing(run_dir: Path, prefix: str) -> bool:
    root = run_dir / "checkpoints"
    try:
        return any(p.name.startswith(prefix) for p in root.iterdir())
    except OSError:
        return False


def _in_phase(run_dir: Path, phase: str) -> bool:
    """Whether the run has reached `phase` (for a checkpoint phase: one is being written right now)."""
    if phase == "sft":
        return _lines(run_dir / "sft" / "metrics.jsonl") >= 1
    if phase == "rl":
        return _lines(run_dir / "metrics.jsonl") >= 1
    return _writing(run_dir, WRITING[phase])


def _where(run_dir: Path) -> dict:
    """What the run had done when it was killed: SFT and RL steps logged, a checkpoint being written."""
    return {
        "sft_steps": _lines(run_dir / "sft" / "metrics.jsonl"),
        "rl_steps": _lines(run_dir / "metrics.jsonl"),
        "writing_checkpoint": _writing(run_dir, ".tmp-"),
    }


def kill_at(process: subprocess.Popen, run_dir: Path, phase: str, delay: float) -> dict:
    """SIGKILL `process` `delay` s after it reaches `phase` (at once for a checkpoint write); its children
    alive 5 s later. If it finishes first, nothing is killed."""
    while not _in_phase(run_dir, phase):
        if process.poll() is not None:
            return {"killed": False, "phase": phase, "leftover": 0}
        time.sleep(0.002 if phase in WRITING else 0.05)
    time.sleep(delay)
    children = descendants(process.pid)
    if process.poll() is not None:
        return {"killed": False, "phase": phase, "leftover": 0}
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    where = _where(run_dir)
    deadline = time.monotonic() + 5
    while any(is_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in children if is_alive(p)]
    for pid in left:  # reported, then cleaned up so that later runs are not disturbed
        os.kill(pid, signal.SIGKILL)
    return {"killed": True, "phase": phase, "at": where, "children": len(children), "leftover": len(left)}


def final_parameters(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "checkpoints" / "latest" / "model.safetensors"))


def max_difference(a: dict, b: dict) -> float:
    """Largest |a - b| over every parameter (inf if the two models do not have the same tensors)."""
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        return float("inf")
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def one_run(work: Path, index: int, rng: random.Random, reference: dict, durations: dict) -> dict:
    run_dir = work / f"run{index}"
    phase = PHASES[index % len(PHASES)]
    kills = [kill_at(_start(run_dir, False), run_dir, phase, rng.uniform(0, 0.8 * durations[phase]))]
    if index % 3 == 2:  # killed a second time, during its resume
        again = rng.choice(("rl", "rl_checkpoint"))
        kills.append(kill_at(_start(run_dir, True), run_dir, again, rng.uniform(0, 0.8 * durations[again])))
    resumed = _start(run_dir, True)
    code = resumed.wait(timeout=900)
    finished = code == 0 and (run_dir / "checkpoints" / "latest").exists()
    difference = max_difference(final_parameters(run_dir), reference) if finished else float("nan")
    return {
        "run": index,
        "kills": kills,
        "finished": finished,
        "exit_code": code,
        "max_parameter_difference": difference,
        "leftover_processes": sum(k["leftover"] for k in kills),
        "log": f"{run_dir.name}.log",  # in the --work directory
    }


def reference_run(work: Path) -> tuple[dict, dict]:
    """The uninterrupted run's final parameters, and how long its SFT and RL phases lasted (s)."""
    run_dir = work / "reference"
    began = time.perf_counter()
    process = _start(run_dir, False)
    marks = {}
    while process.poll() is None:
        for phase in ("sft", "rl"):
            if phase not in marks and _in_phase(run_dir, phase):
                marks[phase] = time.perf_counter()
        time.sleep(0.05)
    if process.returncode != 0:
        raise SystemExit(f"the reference run failed (exit {process.returncode}); see {run_dir}.log")
    ended = time.perf_counter()
    durations = {"sft": marks["rl"] - marks["sft"], "rl": ended - marks["rl"]}
    durations.update({phase: 0.0 for phase in WRITING})
    print(f"reference run: {ended - began:.0f} s (SFT {durations['sft']:.0f} s, RL {durations['rl']:.0f} s)")
    return final_parameters(run_dir), durations


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--work", default=str(ROOT / "bench" / "results" / "chaos_runs"))
    args = parser.parse_args(argv)
    work = Path(args.work)
    if work.exists():
        import shutil

        shutil.rmtree(work)
    work.mkdir(parents=True)
    reference, durations = reference_run(work)
    rng = random.Random(args.seed)
    rows = []
    for index in range(args.runs):
        row = one_run(work, index, rng, reference, durations)
        rows.append(row)
        phases = " then ".join(
            f"{k['phase']} (SFT step {k['at']['sft_steps']}, RL step {k['at']['rl_steps']}"
            f"{', writing a checkpoint' if k['at']['writing_checkpoint'] else ''}; {k['children']} children)"
            if k["killed"]
            else f"{k['phase']} (finished first)"
            for k in row["kills"]
        )
        print(
            f"run {index}: killed during {phases}; finished {row['finished']}, "
            f"max |dparam| {row['max_parameter_difference']:.2e}, leftover processes {row['leftover_processes']}"
        )
    summary = {
        "runs": len(rows),
        "finished": sum(r["finished"] for r in rows),
        "kills": sum(k["killed"] for r in rows for k in r["kills"]),
        "max_parameter_difference": max((r["max_parameter_difference"] for r in rows), default=0.0),
        "leftover_processes": sum(r["leftover_processes"] for r in rows),
    }
    write_results(Path(args.out) / "chaos.json", {"config": CONFIG, "summary": summary, "runs": rows})
    print(
        f"\nChaos: {summary['finished']}/{summary['runs']} runs finished after {summary['kills']} SIGKILLs; "
        f"max |parameter difference| to the uninterrupted run {summary['max_parameter_difference']:.2e}; "
        f"{summary['leftover_processes']} processes left behind"
    )
    ok = summary["finished"] == summary["runs"] and summary["max_parameter_difference"] <= 1e-6
    return 0 if ok and summary["leftover_processes"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
