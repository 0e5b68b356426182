"""The pre-registered comparisons of docs/evidence.md: each run as sweeps, judged by the rule written there
(`python -m bench.evidence`, from the repository's root).

    python -m bench.evidence --comparison c1 --setup tiny      # runs the cells not recorded yet
    python -m bench.evidence --comparison c2 --setup smollm2   # needs `make smollm2`
    python -m bench.evidence --summary                         # the contrasts and verdicts so far
    python -m bench.evidence --rejudge                         # the file's contrasts, under the rules in force
    python -m bench.evidence --readme                          # the README's claims table from the file
    python -m bench.evidence --merge GPU/evidence.json         # the runs another copy recorded, added
    python -m bench.evidence --comparison c1 --setup tiny --tiny --seeds 0 1   # a smoke run, in seconds

A run is recorded in bench/results/evidence.json (its held-out figures and a few training figures) when
its sweep ends, so the work carries across sessions and machines through the committed JSON: a later
call runs only the (arm, seed) cells not recorded, all of them in one sweep where they can be (both cores
busy). On the same machine, the cells a killed call finished are recorded by the next call, and the ones
it cut short resume from their checkpoints (the sweeps under bench/results/evidence_runs/). A finished
cell's checkpoints are deleted once it is recorded (its record needs only eval.json and metrics.jsonl; a
MoE cell would otherwise keep 8 GB): `--keep-checkpoints` keeps them. Each contrast
is recomputed from the records at every write: the paired differences by seed, their mean, the 95%
t-interval, the p-value, Holm's adjustment within the comparison and the verdict (docs/evidence.md as
amended 2026-11-27), given once every pre-registered seed of the comparison's judged contrasts is in;
beside it the verdict of the rule as first written (a percentile bootstrap of the first seeds).

Calls on different comparisons may run at the same time (with `OMP_NUM_THREADS=1`, say, so that
together they use each core once): each writes its own comparison's records into the file as it is when
it saves, under a lock, atomically.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from bench.common import RESULTS, repo_override, repo_path
from bench.evidence.plan import COMPARISONS, SETUPS, TEACHER_SEED, Comparison, Setup
from bench.evidence.store import load, locked, merge_file, save, write
from bench.evidence.verdicts import write_readme
from bench.quality.algorithms import TINY, prepare_sft

QUIET = ["logging.progress=false", "logging.tensorboard=false"]


# ---------------------------------------------------------------- the plan of a comparison on a setup
def fixed_overrides(
    comparison: Comparison, setup: Setup, base: list[str], sft_dir: Path | None, steps: int
) -> list[str]:
    """What every run of `comparison` on `setup` is given besides its arm's keys and its seed: `steps` RL
    steps (the setup's, but for a smoke run), or as many rollouts as those steps make."""
    from everyprompt.config import load_config

    fixed = [*base, *QUIET, *comparison.fixed]
    if sft_dir is not None:
        fixed += [f"model.path={sft_dir}", "sft.steps=0"]
    steps = comparison.steps or steps * comparison.steps_factor
    fixed.append(f"rl.steps={steps}")
    if comparison.equal_rollouts:
        config = load_config(setup.config, fixed)
        budget = steps * config.rl.prompts_per_step * config.rl.group_size
        fixed += [f"rl.max_rollouts={budget}", f"rl.steps={10 * steps}"]  # the budget binds first
    return fixed


def prepare_teacher(config_path: Path | None, overrides: list[str], out: Path) -> tuple[Path, dict]:
    """Train (or reuse, or finish) a comparison's teacher at `out`: the config at `config_path` (None: the
    demo's) with `overrides`; its final checkpoint and its held-out figures."""
    from everyprompt.config import load_config
    from everyprompt.pipeline import train
    from everyprompt.run.layout import RunLayout

    layout = RunLayout(out)
    if not (layout.root / "eval.json").is_file():
        config = load_config(config_path, [*overrides, "logging.progress=true", "logging.tensorboard=false"])
        train(config, run_dir=out, resume=layout.config.is_file())
    final = json.loads((layout.root / "eval.json").read_text())
    return layout.latest.resolve(), {"run_dir": repo_path(out), **_headline(final)}


def _headline(final: dict) -> dict:
    """An eval.json's overall greedy accuracy and pass@k (not a level's)."""
    return {
        "greedy_accuracy": final["greedy_accuracy"],
        "pass_at_k": next((v for k, v in final.items() if k.startswith("pass@") and "/" not in k), None),
    }


def record_of(arm: str, seed: int, run_dir: Path, seconds: float, levels: list[int] | None) -> dict:
    """One finished run's figures, from its eval.json and metrics.jsonl."""
    from everyprompt.report import load_metrics

    final = json.loads((run_dir / "eval.json").read_text())
    history = load_metrics(run_dir / "metrics.jsonl").records
    zero = [m["zve/zero_variance_rate"] for m in history if "zve/zero_variance_rate" in m]
    steps = [m["time/step_s"] for m in history if "time/step_s" in m]
    by_level = {k.rpartition("_")[2]: v for k, v in final.items() if k.startswith("greedy_accuracy/level_")}
    by_task = {
        k.removeprefix("greedy_accuracy/task_"): v
        for k, v in final.items()
        if "/task_" in k and k.startswith("greedy")
    }
    on_rl_levels = [by_level[str(level)] for level in levels or [] if str(level) in by_level]
    taught = [m["distill/reverse_kl"] for m in history if "distill/reverse_kl" in m]
    return {
        "arm": arm,
        "seed": seed,
        **_headline(final),
        "greedy_accuracy_by_level": by_level,
        **({"greedy_accuracy_by_task": by_task} if by_task else {}),  # reasoning-gym's tasks
        "greedy_accuracy_rl_levels": statistics.mean(on_rl_levels) if on_rl_levels else None,
        "zero_variance_rate_mean": statistics.mean(zero) if zero else None,
        "step_s_median": statistics.median(steps) if steps else None,
        "rl_steps": len(history),
        "rollouts": max((m.get("rollout/total", 0) for m in history), default=0),
        "seconds": seconds,
        "run_dir": repo_path(run_dir),
        # the held-out curve (step -> greedy accuracy at each evaluation) and, with a teacher, the reverse KL
        # to it at the first and the last step
        "greedy_accuracy_by_step": {
            str(int(m["step"])): m["eval/greedy_accuracy"] for m in history if "eval/greedy_accuracy" in m
        },
        "distill_reverse_kl_first_last": [taught[0], taught[-1]] if taught else None,
    }


# ---------------------------------------------------------------- running what is missing
def adopt_cut_short(root: Path, sweep_dir: Path, plan) -> list[tuple[str, Path]]:
    """The cells of `plan` that a stopped call left cut short (checkpointed, not finished) in another sweep
    of the same settings under `root`, moved into `sweep_dir` so that they resume from their checkpoints
    instead of starting over: a call names its sweeps by the cells it runs, which change once some are
    recorded. Returns (cell, where it was) for each."""
    from everyprompt.run.layout import RunLayout
    from everyprompt.sweep import SweepPlan
    from everyprompt.sweep.runner import cell_is_done

    others = [  # the other sweeps of the same settings
        plan_file.parent
        for plan_file in sorted(root.glob("*/sweep.json"))
        if plan_file.parent != sweep_dir and SweepPlan.load(plan_file.parent).fixed == plan.fixed
    ]
    moved = []
    for cell in plan.cells():
        target = sweep_dir / cell.name
        if RunLayout(target).started():
            continue
        for source in (other / cell.name for other in others):
            if not cell_is_done(source) and RunLayout(source).step_checkpoints():
                shutil.rmtree(target, ignore_errors=True)
                shutil.move(source, target)
                moved.append((cell.name, source))
                break
    return moved


def harvest(
    root: Path, body: dict, fixed: list[str], levels: list[int] | None, keep_checkpoints: bool = False
) -> None:
    """Record every finished cell of the sweeps under `root` whose (arm, seed) is not recorded yet and
    whose sweep ran with `fixed` (a sweep of other settings is left alone); then, unless
    `keep_checkpoints`, delete the checkpoints of every cell of those sweeps whose (arm, seed) is
    recorded: a finished one, or a stopped one that another sweep has since run whole (nothing resumes
    either)."""
    from everyprompt.run.layout import RunLayout
    from everyprompt.sweep import SweepPlan
    from everyprompt.sweep.runner import cell_is_done

    cells = []  # (arm, seed, its directory) of every cell of the sweeps that ran with `fixed`
    for plan_file in sorted(root.glob("*/sweep.json")):
        plan = SweepPlan.load(plan_file.parent)
        if plan.fixed != fixed:
            continue
        status_file = plan_file.parent / "status.json"
        status = json.loads(status_file.read_text()) if status_file.is_file() else {}
        for cell in plan.cells():
            runs, cell_dir = body["arms"][cell.arm]["runs"], plan_file.parent / cell.name
            cells.append((cell.arm, cell.seed, cell_dir))
            if cell_is_done(cell_dir) and not any(r["seed"] == cell.seed for r in runs):
                seconds = status.get(cell.name, {}).get("seconds") or float("nan")
                runs.append(record_of(cell.arm, cell.seed, cell_dir, seconds, levels))
                runs.sort(key=lambda r: r["seed"])
    if keep_checkpoints:
        return
    for arm, seed, cell_dir in cells:
        if any(r["seed"] == seed for r in body["arms"][arm]["runs"]):  # nothing resumes it now
            shutil.rmtree(RunLayout(cell_dir).checkpoints, ignore_errors=True)


def run(
    name: str,
    setup_name: str,
    seeds: list[int],
    path: Path,
    work: Path,
    smoke: bool,
    workers: int,
    keep_checkpoints: bool = False,
    seed_by_seed: bool = False,
    only: list[str] | None = None,
):
    from rich.console import Console

    from everyprompt.config import demo_config_path, load_config, read_yaml
    from everyprompt.processes import StopRequested
    from everyprompt.sweep import SweepPlan, SweepRunner

    comparison, setup = COMPARISONS[name], SETUPS[setup_name]
    if comparison.runner is not None:
        raise SystemExit(f"{name}'s cells are not sweeps: `python -m {comparison.runner}` runs them")
    if setup_name not in comparison.setups:
        raise SystemExit(
            f"{name} is not run on {setup_name} (docs/evidence.md: {', '.join(comparison.setups)})"
        )
    unknown = sorted(set(only or []) - set(comparison.arms))
    if unknown:
        raise SystemExit(f"{name} has no arm {', '.join(unknown)} (its arms: {', '.join(comparison.arms)})")
    if setup.needs is not None and not setup.needs.exists():
        raise SystemExit(
            f"{setup_name} needs {repo_path(setup.needs)}: `make smollm2` (and `make smollm2-moe`)"
        )
    console = Console(width=110)
    base = TINY + ["eval.num_samples=2", "eval.pass_k=2"] if smoke else []
    sft_dir = None
    if setup.shared_sft:
        console.print("the shared SFT checkpoint (trained once, then reused) ...")
        sft_dir = prepare_sft([*base, "seed=1"], work / ("sft_smoke" if smoke else "sft_seed1"))
    # a smoke run takes 2 steps, whatever the comparison's own count
    steps = 2 if smoke else setup.steps
    planned = replace(comparison, steps=None) if smoke else comparison
    fixed = fixed_overrides(planned, setup, base, sft_dir, steps)
    arms_of = dict(comparison.arms)
    if comparison.teacher:
        console.print(f"the teacher (GRPO from the SFT checkpoint, seed {TEACHER_SEED}; trained once) ...")
        own = fixed_overrides(replace(comparison, steps=None), setup, base, sft_dir, steps)  # full budget
        teacher_fixed = [*own, f"seed={TEACHER_SEED}"]
        teacher_dir, teacher = prepare_teacher(
            setup.config, teacher_fixed, work / f"teacher_{setup_name}_seed{TEACHER_SEED}"
        )
        arms_of = {arm: [o.format(teacher=teacher_dir) for o in keys] for arm, keys in arms_of.items()}
    config_path = setup.config or demo_config_path()
    levels = load_config(setup.config, fixed).rl.levels
    payload = load(path)
    entry = payload["comparisons"].setdefault(name, {"title": comparison.title, "setups": {}})
    body = entry["setups"].setdefault(setup_name, {"arms": {}})
    body["fixed"] = [repo_override(o) for o in fixed]  # paths relative to the repository
    body["seeds"] = list(comparison.seeds_on(setup_name))
    if comparison.teacher:
        body["teacher"] = teacher
    for arm, keys in arms_of.items():
        recorded = [repo_override(o) for o in keys]
        body["arms"].setdefault(arm, {"overrides": recorded, "runs": []})
    root = work / f"{name}-{setup_name}"
    harvest(root, body, fixed, levels, keep_checkpoints)  # cells a killed call finished on this machine
    wanted = [arm for arm in arms_of if not only or arm in only]
    for pending, arms in pending_sweeps(body, wanted, seeds, seed_by_seed):
        console.print(f"{name} on {setup_name}: {', '.join(arms)} x seeds {list(pending)}")
        bundle = {arm: arms_of[arm] for arm in arms}
        plan = SweepPlan(read_yaml(config_path), fixed, {}, list(pending), str(config_path), bundle)
        plan.validate()
        sweep_dir = root / f"seeds{'-'.join(map(str, pending))}-{'-'.join(arms)}"
        plan.save(sweep_dir)
        for cell, source in adopt_cut_short(root, sweep_dir, plan):
            console.print(f"{cell}: resumes where a stopped call left it ({repo_path(source)})")
        try:
            SweepRunner(plan, sweep_dir, workers, console).run()
        except StopRequested as stop:  # Ctrl-C / SIGTERM: the cells checkpointed; keep what finished
            harvest(root, body, fixed, levels, keep_checkpoints)
            save(path, payload, smoke, name, setup_name)
            console.print(f"stopped; the same command continues ({stop})")
            raise SystemExit(stop.exit_code) from None
        harvest(root, body, fixed, levels, keep_checkpoints)
    payload = save(path, payload, smoke, name, setup_name)
    console.print(summary(payload))


def pending_sweeps(
    body: dict, arms: list[str], seeds: list[int], seed_by_seed: bool = False
) -> list[tuple[tuple[int, ...], list[str]]]:
    """The sweeps that run the cells `body` has not recorded, as (seeds, arms): one per set of arms that
    miss the same seeds, all of them at once when nothing is recorded (the workers stay busy; a sweep
    runs its cells seed fastest, arm by arm); no recorded cell is run again. `seed_by_seed`: one sweep per
    seed instead, so that a call stopped early has finished whole seeds, every arm of each (pairs),
    rather than some arms' every seed."""
    recorded = {arm: {r["seed"] for r in body["arms"][arm]["runs"]} for arm in arms}
    missing = {arm: [s for s in seeds if s not in recorded[arm]] for arm in arms}
    if seed_by_seed:
        sweeps = [((seed,), [arm for arm in arms if seed in missing[arm]]) for seed in seeds]
        return [(seed, wanting) for seed, wanting in sweeps if wanting]
    by_seeds: dict[tuple[int, ...], list[str]] = {}
    for arm in arms:
        if missing[arm]:
            by_seeds.setdefault(tuple(missing[arm]), []).append(arm)
    return list(by_seeds.items())


def summary(payload: dict):
    """The recorded contrasts as the console shows them (report/evidence.py's table)."""
    from everyprompt.report.evidence import evidence_table

    return evidence_table(payload)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--comparison", choices=list(COMPARISONS))
    parser.add_argument("--setup", choices=list(SETUPS))
    parser.add_argument("--seeds", type=int, nargs="+", help="default: the setup's pre-registered seeds")
    parser.add_argument("--workers", type=int, default=2, help="runs at a time (each its share of the cores)")
    parser.add_argument(
        "--seed-by-seed",
        action="store_true",
        help="finish every arm of one seed before the next (a call that may be cut short keeps pairs)",
    )
    parser.add_argument("--arms", nargs="+", help="run only these arms' missing cells (default: every arm)")
    parser.add_argument("--summary", action="store_true", help="print the recorded contrasts, run nothing")
    parser.add_argument("--readme", action="store_true", help="write the README's claims table, run nothing")
    parser.add_argument(
        "--rejudge", action="store_true", help="recompute the file's contrasts under the rules in force"
    )
    parser.add_argument(
        "--merge",
        type=Path,
        metavar="FILE",
        help="add the runs FILE records and this file lacks, run nothing",
    )
    parser.add_argument("--tiny", action="store_true", help="a smoke run on a 2-layer model (its own file)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--keep-checkpoints", action="store_true", help="keep a finished cell's checkpoints once recorded"
    )
    args = parser.parse_args(argv)
    path = args.out / ("evidence_smoke.json" if args.tiny else "evidence.json")
    if args.summary:
        from rich.console import Console

        Console(width=140).print(summary(load(path)))
        return 0
    if args.rejudge:
        with locked(path):
            write(path, load(path), load(path).get("smoke", False))
        print(f"rejudged {repo_path(path)}")
        return 0
    if args.merge:
        return merge_file(path, args.merge)
    if args.readme:
        write_readme(load(path))
        print("wrote the claims table into README.md")
        return 0
    if args.comparison is None or args.setup is None:
        parser.error("--comparison and --setup name what to run (or --summary)")
    seeds = args.seeds or list(COMPARISONS[args.comparison].seeds_on(args.setup))
    work = args.out / "evidence_runs"
    run(
        args.comparison,
        args.setup,
        seeds,
        path,
        work,
        args.tiny,
        args.workers,
        args.keep_checkpoints,
        args.seed_by_seed,
        args.arms,
    )
    print(f"wrote {repo_path(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
