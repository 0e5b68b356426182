"""`everyprompt sweep`: a grid of runs (config overrides x seeds) under one sweep directory.

    everyprompt sweep configs/demo.yaml rl.loss=ppo_clip,espo --seeds 0,1 --parallel 2
    everyprompt sweep --resume runs/sweep-demo-...       # after a kill, a failure or Ctrl-C
    everyprompt report runs/sweep-demo-... --html        # the table and curves across the cells

Layout: `SWEEP/sweep.json` (the plan), `SWEEP/base.yaml` (the base config as it was), `SWEEP/status.json`
(how each cell ended), and one normal run directory per cell, `SWEEP/<key>=<value>,...,seed=<s>/`, with
the cell's console output in `output.log`. docs/sweeps.md has the whole story.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from rich.console import Console

from everyprompt.config import ConfigError
from everyprompt.run.layout import SweepLayout
from everyprompt.sweep.plan import Cell, SweepPlan, parse_axes, split_values
from everyprompt.sweep.runner import Outcome, SweepRunner, cell_is_done


def prepare(
    config: str | None,
    arguments: list[str],
    seeds: str | None,
    sweep_dir: str | Path | None = None,
    resume: str | Path | None = None,
) -> tuple[SweepPlan, Path]:
    """The plan and its directory: a new sweep (saved), the one in `resume`, or the same plan again in an
    existing `sweep_dir` (a different plan there is refused: two sweeps never share a directory)."""
    if resume is not None:
        if config is not None or arguments or seeds is not None:
            raise ConfigError(
                "sweep --resume DIR takes no config, overrides or --seeds: they are in "
                f"DIR/{SweepLayout(resume).plan.name}"
            )
        directory = Path(resume)
        return SweepPlan.load(directory), directory
    plan = SweepPlan.build(config, arguments, seeds)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    directory = Path(sweep_dir or f"runs/sweep-{plan.base.get('name', 'run')}-{stamp}")
    if SweepLayout(directory).is_sweep():
        different = SweepPlan.load(directory).same_as(plan)
        if different:
            raise ConfigError(
                f"{directory} holds another sweep ({', '.join(different)} differ from this command's); "
                f"resume it with `everyprompt sweep --resume {directory}` or choose another --run-dir"
            )
    elif directory.exists() and any(directory.iterdir()):
        raise ConfigError(
            f"--run-dir {directory}: exists and is not a sweep directory (no {SweepLayout(directory).plan.name})"
        )
    plan.save(directory)
    return plan, directory


def run_sweep(plan: SweepPlan, sweep_dir: Path, parallel: int = 1, console: Console | None = None) -> dict:
    """Run the plan's cells not done yet; returns {cell name: Outcome}."""
    return SweepRunner(plan, sweep_dir, parallel, console).run()


__all__ = [
    "Cell",
    "Outcome",
    "SweepPlan",
    "SweepRunner",
    "cell_is_done",
    "parse_axes",
    "prepare",
    "run_sweep",
    "split_values",
]
