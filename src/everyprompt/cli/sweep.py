"""`everyprompt sweep`: a grid of runs (config overrides x seeds), resumable."""

from __future__ import annotations

from everyprompt.cli.args import EXIT_FAILURE, split_config_args
from everyprompt.config import ConfigError


def cmd_sweep(args) -> int:
    from rich.console import Console

    from everyprompt.report.console import sweep_table
    from everyprompt.sweep import prepare, run_sweep
    from everyprompt.sweep.runner import held_out_accuracy

    config, arguments = split_config_args(args.config)
    if args.parallel < 1:
        raise ConfigError(f"--parallel {args.parallel}: expected at least 1 cell at a time")
    plan, sweep_dir = prepare(config, arguments, args.seeds, args.run_dir, args.resume)
    console = Console(stderr=True)
    cells = plan.cells()
    axes = (
        ", ".join(f"{key} in {{{', '.join(values)}}}" for key, values in plan.grid.items()) or "no grid axis"
    )
    console.print(
        f"sweep {sweep_dir}: {len(cells)} cells ({axes}; seeds {', '.join(map(str, plan.seeds))}), "
        f"{args.parallel} at a time"
    )
    outcomes = run_sweep(plan, sweep_dir, args.parallel, console)
    rows = [
        (
            cell.name,
            outcomes[cell.name].state,
            held_out_accuracy(sweep_dir / cell.name),
            outcomes[cell.name].seconds,
        )
        for cell in cells
    ]
    console.print(sweep_table(f"sweep {sweep_dir}", rows))
    failed = [name for name, outcome in outcomes.items() if outcome.state == "failed"]
    console.print(f"`everyprompt report {sweep_dir} --html` compares the cells")
    if failed:
        console.print(
            f"{len(failed)} of {len(cells)} cells failed (their output.log says why); "
            f"`everyprompt sweep --resume {sweep_dir}` retries them"
        )
        return EXIT_FAILURE
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("sweep", help="a grid of runs: KEY=v1,v2 axes times --seeds, one run directory each")
    p.add_argument("config", nargs="*", help="optional CONFIG.yaml, then KEY=VALUE or KEY=v1,v2 overrides")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default: the config's seed)")
    p.add_argument("--parallel", type=int, default=1, help="cells run at a time (they share the cores)")
    p.add_argument("--run-dir", default=None, help="the sweep directory (default: runs/sweep-<name>-<time>)")
    p.add_argument("--resume", default=None, metavar="SWEEP_DIR", help="continue a sweep: skip done cells")
    p.set_defaults(func=cmd_sweep, own_signals=True)  # it tells each cell, which checkpoints
