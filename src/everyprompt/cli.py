"""The `everyprompt` command: parses arguments, builds objects, calls the library.

    everyprompt demo [--seed S] [KEY=VALUE ...]
    everyprompt train [CONFIG.yaml] [KEY=VALUE ...] [--run-dir D] [--resume RUN_DIR]
    everyprompt sft [CONFIG.yaml] [KEY=VALUE ...] [--run-dir D]
    everyprompt eval CHECKPOINT [--data FILE] [CONFIG.yaml] [KEY=VALUE ...]
    everyprompt score INPUT.jsonl --reward math [--completion-field F] [--answer-field F] [-o OUT]
    everyprompt filter DATA|builtin --model CKPT [--samples K] [--low L] [--high H] [--out DIR]
    everyprompt sweep [CONFIG.yaml] KEY=v1,v2 ... [--seeds 0,1,2] [--parallel N] [--run-dir D]
    everyprompt sweep --resume SWEEP_DIR
    everyprompt report RUN_OR_SWEEP [RUN ...] [--html [REPORT.html]]

A bad config, data file, checkpoint or reward exits with code 2 and a one-line message.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from everyprompt.config import Config, ConfigError, load_config
from everyprompt.distributed.runtime import ClusterError

EXIT_USAGE = 2
EXIT_FAILURE = 1


def _split_config_args(values: list[str]) -> tuple[str | None, list[str]]:
    files = [v for v in values if "=" not in v]
    if len(files) > 1:
        raise ConfigError(f"expected at most one config file, got {files}; overrides are KEY=VALUE")
    return (files[0] if files else None), [v for v in values if "=" in v]


def _config(values: list[str], extra: list[str] = ()) -> Config:
    path, overrides = _split_config_args(values)
    return load_config(path, [*overrides, *extra])


def cmd_demo(args) -> int:
    from everyprompt.pipeline import demo

    extra = [f"seed={args.seed}"] if args.seed is not None else []
    config = _config(args.config, extra)
    demo(config, run_dir=args.run_dir)
    return 0


def cmd_train(args) -> int:
    from everyprompt.pipeline import train

    if args.resume:
        saved = Path(args.resume) / "config.yaml"
        if not saved.is_file():
            raise ConfigError(f"--resume {args.resume}: no config.yaml there; is it a run directory?")
        config = load_config(saved, _split_config_args(args.config)[1])
        train(config, run_dir=args.resume, resume=True)
    else:
        train(_config(args.config), run_dir=args.run_dir)
    return 0


def cmd_sft(args) -> int:
    from everyprompt.pipeline import Run

    run = Run(_config(args.config), args.run_dir)
    run.warm_started_model()
    run.console.print(f"SFT checkpoint: {run.run_dir / 'checkpoints' / 'sft'}")
    return 0


def cmd_eval(args) -> int:
    from everyprompt.data import load_prompt_file
    from everyprompt.models.io import load_pretrained
    from everyprompt.pipeline import Run
    from everyprompt.rollout import build_engine
    from everyprompt.trainer import resolve_checkpoint

    config = _config(args.config)
    checkpoint = resolve_checkpoint(args.checkpoint)
    run = Run(config, run_dir=args.run_dir or checkpoint / "eval")  # also quiets library progress bars
    model, tokenizer = load_pretrained(checkpoint)
    given = {"prompt": args.prompt_field, "answer": args.answer_field}
    columns = {**config.data.columns, **{field: name for field, name in given.items() if name}}
    rows = load_prompt_file(args.data, columns) if args.data else None
    engine = build_engine(config.rollout, model, tokenizer)
    results = run.evaluate(engine, tokenizer, rows)
    (run.run_dir / "eval.json").write_text(json.dumps(results, indent=2))
    _print_eval(results, config.eval.pass_k)
    return 0


def _print_eval(results: dict[str, float], pass_k: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Held-out evaluation ({int(results['num_prompts'])} prompts)")
    table.add_column("split")
    table.add_column("greedy pass@1", justify="right")
    table.add_column(f"pass@{pass_k}", justify="right")
    levels = sorted(k.split("/", 1)[1] for k in results if k.startswith("greedy_accuracy/"))
    for label, suffix in [("overall", "")] + [(lvl, "/" + lvl) for lvl in levels]:
        sampled = results.get(f"pass@{pass_k}{suffix}")
        table.add_row(
            label, f"{results['greedy_accuracy' + suffix]:.1%}", "-" if sampled is None else f"{sampled:.1%}"
        )
    Console().print(table)


def cmd_score(args) -> int:
    from everyprompt.data.datasets import read_jsonl
    from everyprompt.rewards import get_reward, score_completions
    from everyprompt.rewards.base import reward_columns, summarize_failures

    fields = (args.completion_field, args.answer_field)
    rows = read_jsonl(args.input, required=fields)
    fn = get_reward(args.reward)
    columns = reward_columns(rows)
    columns["answer"] = [str(row[args.answer_field]) for row in rows]
    columns.pop(args.completion_field, None)
    completions = [str(row[args.completion_field]) for row in rows]
    rewards, failures = score_completions(fn, completions, columns)
    out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    try:
        for row, reward in zip(rows, rewards):
            out.write(json.dumps({**row, "reward": reward}) + "\n")
    finally:
        if args.output:
            out.close()
    scored = [r for r in rewards if r is not None]
    mean = sum(scored) / len(scored) if scored else float("nan")
    print(f"scored {len(rows)} rows: mean reward {mean:.4f}, {len(failures)} errors", file=sys.stderr)
    for summary, (count, first) in summarize_failures(failures).items():
        print(f"  {count} x {summary}\n{first.traceback}", file=sys.stderr)
    return 0


def cmd_filter(args) -> int:
    """ZVE stage 0: estimate each prompt's pass rate with K samples; keep low < p < high."""
    from rich.console import Console
    from rich.table import Table

    from everyprompt.data import load_prompt_file
    from everyprompt.data.passrate import PassRateStore
    from everyprompt.models.io import load_pretrained
    from everyprompt.pipeline import Run, run_offline_filter
    from everyprompt.trainer import resolve_checkpoint

    extra = [
        f"zve.filter.{key}={value}"
        for key in ("samples", "low", "high")
        if (value := getattr(args, key)) is not None
    ]
    config = _config(args.config, extra)
    rules = config.zve.filter
    checkpoint = resolve_checkpoint(args.model)
    out = Path(
        args.out or (f"{Path(args.data).stem}-filtered" if args.data != "builtin" else "builtin-filtered")
    )
    # a bad data file fails before anything is written
    rows = None if args.data == "builtin" else load_prompt_file(args.data, config.data.columns)
    run = Run(config, run_dir=out)
    rows = run.rl_rows() if rows is None else rows
    model, tokenizer = load_pretrained(checkpoint)
    store = PassRateStore(out / "passrates.sqlite")
    estimate, result = run_offline_filter(model, tokenizer, rows, config, store)
    store.close()
    with open(out / "kept.jsonl", "w", encoding="utf-8") as handle:
        for index in result.kept:
            rate = estimate.rate(index)
            handle.write(
                json.dumps({**rows[index], "pass_rate": rate, "attempts": estimate.attempts[index]}) + "\n"
            )
    report = {
        "data": args.data,
        "model": str(checkpoint),
        "prompts": len(rows),
        "samples": rules.samples,
        "low": rules.low,
        "high": rules.high,
        "kept": len(result.kept),
        "too_easy": result.too_easy,
        "too_hard": result.too_hard,
        "unscored": result.unscored,
        "reward_errors": estimate.errors,
        "histogram": result.histogram,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    _plot_pass_rates(estimate, rules, out / "pass_rates.png")
    table = Table(title=f"Pass rates of {len(rows)} prompts, {rules.samples} samples each")
    table.add_column("pass rate", justify="right")
    table.add_column("prompts", justify="right")
    for value, count in result.histogram.items():
        table.add_row(value, str(count))
    console = Console()
    console.print(table)
    console.print(
        f"kept {len(result.kept)} (low < p < high: {rules.low:g} < p < {rules.high:g}); dropped "
        f"{result.too_easy} too easy, {result.too_hard} too hard, {result.unscored} unscored\n"
        f"wrote {out}/kept.jsonl, report.json, pass_rates.png, passrates.sqlite"
    )
    return 0


def cmd_sweep(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from everyprompt.sweep import prepare, run_sweep
    from everyprompt.sweep.runner import held_out_accuracy

    config, arguments = _split_config_args(args.config)
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
    table = Table(title=f"sweep {sweep_dir}")
    for column in ("cell", "state", "held-out greedy", "minutes"):
        table.add_column(column, justify="left" if column == "cell" else "right")
    for cell in cells:
        outcome = outcomes[cell.name]
        accuracy = held_out_accuracy(sweep_dir / cell.name)
        table.add_row(
            cell.name,
            outcome.state,
            f"{accuracy:.1%}" if accuracy is not None else "-",
            f"{outcome.seconds / 60:.1f}" if outcome.seconds else "-",
        )
    console.print(table)
    failed = [name for name, outcome in outcomes.items() if outcome.state == "failed"]
    console.print(f"`everyprompt report {sweep_dir} --html` compares the cells")
    if failed:
        console.print(
            f"{len(failed)} of {len(cells)} cells failed (their output.log says why); "
            f"`everyprompt sweep --resume {sweep_dir}` retries them"
        )
        return EXIT_FAILURE
    return 0


def cmd_report(args) -> int:
    paths = [Path(p) for p in args.runs]
    single = len(paths) == 1 and not (paths[0] / "sweep.json").is_file()
    if single:
        _report_one(paths[0])
    if args.html is None and single:
        return 0
    from rich.console import Console

    from everyprompt.report.html import write_html
    from everyprompt.report.runs import arms_of, load_runs

    runs = load_runs(paths)
    arms = arms_of(runs)
    console = Console(width=None if sys.stdout.isatty() else 160)
    if not single:
        console.print(_comparison_table(arms))
    if args.html is not None:
        if args.html:
            target = Path(args.html)
        elif single:
            target = paths[0] / "report" / "report.html"
        else:
            target = paths[0] / "report.html" if len(paths) == 1 else Path("report.html")
        title = f"everyprompt report: {', '.join(p.name for p in paths)}"
        console.print(
            f"wrote {write_html(runs, arms, target, title)} (one file: figures inline, opens from disk)"
        )
    else:
        console.print(f"`everyprompt report {' '.join(args.runs)} --html` adds the curves, in one HTML file")
    return 0


def _comparison_table(arms):
    from rich.table import Table

    from everyprompt.report.compare import describe, describe_difference, summary

    columns, table = summary(arms)
    out = Table(title=f"{sum(len(a.runs) for a in arms)} runs, {len(arms)} arms (mean ± sd over seeds)")
    out.add_column("arm")
    out.add_column("runs", justify="right")
    for column in columns:
        out.add_column(column.label, justify="right")
    for arm, entries in zip(arms, table):
        cells = []
        for column, entry in zip(columns, entries):
            difference = describe_difference(entry.difference, column.percent)
            cells.append(describe(entry, column.percent) + (f"\n{difference}" if difference else ""))
        out.add_row(arm.name, str(len(arm.runs)), *cells)
    out.caption = f"differences: to {arms[0].name}, with 95% bootstrap intervals over seeds"
    return out


def _report_one(run_dir: Path) -> None:
    """The single-run report: table on the console, summary.md / summary.json / curves in RUN/report/."""
    from rich.console import Console
    from rich.table import Table

    from everyprompt.report import format_row, report

    summary = report(run_dir)
    console = Console()
    out = run_dir / "report"
    for name in ("rl", "sft"):
        part = summary.get(name)
        if part is None:
            continue
        table = Table(title=f"{name.upper()}: {part['steps']} steps")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for row in part["rows"]:
            table.add_row(
                row["label"],
                format_row(row) + (f" ({row['non_finite']} non-finite)" if row["non_finite"] else ""),
            )
        console.print(table)
    demo = summary.get("demo")
    if demo:
        console.print(
            f"demo: held-out greedy accuracy {demo['accuracy_before_rl']:.1%} -> {demo['accuracy_after_rl']:.1%}"
        )
    files = ["summary.md", "summary.json"] + [
        p["curves"] for p in (summary.get("rl"), summary.get("sft")) if p and p["curves"]
    ]
    console.print(f"wrote {out}/: {', '.join(files)}")


def _plot_pass_rates(estimate, rules, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r for i in range(len(estimate.attempts)) if (r := estimate.rate(i)) is not None]
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.hist(rates, bins=rules.samples + 1, range=(0, 1), color="#4c72b0", edgecolor="white")
    axis.axvline(rules.low, color="#c44e52", linestyle="--")
    axis.axvline(rules.high, color="#c44e52", linestyle="--")
    axis.set_xlabel(f"pass rate ({rules.samples} samples)")
    axis.set_ylabel("prompts")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="everyprompt", description="RL post-training for reasoning models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="SFT warm start, RL and held-out eval of a tiny MoE on CPU")
    p.add_argument("config", nargs="*", help="optional CONFIG.yaml, then KEY=VALUE overrides")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--run-dir", default=None)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("train", help="SFT warm start (if configured) then RL")
    p.add_argument(
        "config", nargs="*", help="CONFIG.yaml (default: the demo config), then KEY=VALUE overrides"
    )
    p.add_argument("--run-dir", default=None)
    p.add_argument(
        "--resume", default=None, metavar="RUN_DIR", help="continue a run from its latest checkpoint"
    )
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("sft", help="supervised warm start on worked solutions")
    p.add_argument("config", nargs="*")
    p.add_argument("--run-dir", default=None)
    p.set_defaults(func=cmd_sft)

    p = sub.add_parser("eval", help="greedy pass@1 and sampled pass@k of a checkpoint")
    p.add_argument("checkpoint", help="checkpoint directory or run directory")
    p.add_argument("config", nargs="*")
    p.add_argument(
        "--data", default=None, help="a data file with prompt and answer columns (as data.train_file)"
    )
    p.add_argument("--prompt-field", default=None, help="the prompt's column (default: data.columns.prompt)")
    p.add_argument("--answer-field", default=None, help="the answer's column (default: data.columns.answer)")
    p.add_argument("--run-dir", default=None, help="where eval.json goes (default: CHECKPOINT/eval)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("score", help="score completions in a JSONL file with a reward function")
    p.add_argument("input")
    p.add_argument("--reward", default="math", help="registered name or package.module:function")
    p.add_argument("--completion-field", default="completion")
    p.add_argument("--answer-field", default="answer")
    p.add_argument("-o", "--output", default=None, help="output JSONL (default: stdout)")
    p.set_defaults(func=cmd_score)

    p = sub.add_parser(
        "filter", help="ZVE stage 0: estimate pass rates, keep prompts neither solved nor hopeless"
    )
    p.add_argument("data", help="JSONL/Parquet prompts (prompt, answer), or 'builtin' for the config's task")
    p.add_argument("config", nargs="*", help="optional CONFIG.yaml, then KEY=VALUE overrides")
    p.add_argument("--model", required=True, help="checkpoint directory or run directory")
    p.add_argument("--samples", type=int, default=None, help="samples per prompt (zve.filter.samples)")
    p.add_argument("--low", type=float, default=None, help="drop p <= low (zve.filter.low)")
    p.add_argument("--high", type=float, default=None, help="drop p >= high (zve.filter.high)")
    p.add_argument("--out", default=None, help="output directory (default: DATA-filtered)")
    p.set_defaults(func=cmd_filter)

    p = sub.add_parser("sweep", help="a grid of runs: KEY=v1,v2 axes times --seeds, one run directory each")
    p.add_argument("config", nargs="*", help="optional CONFIG.yaml, then KEY=VALUE or KEY=v1,v2 overrides")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default: the config's seed)")
    p.add_argument("--parallel", type=int, default=1, help="cells run at a time (they share the cores)")
    p.add_argument("--run-dir", default=None, help="the sweep directory (default: runs/sweep-<name>-<time>)")
    p.add_argument("--resume", default=None, metavar="SWEEP_DIR", help="continue a sweep: skip done cells")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser(
        "report", help="a run's summary and curves; several runs or a sweep side by side (--html: one file)"
    )
    p.add_argument("runs", nargs="+", metavar="RUN_OR_SWEEP", help="run directories and/or sweep directories")
    p.add_argument(
        "--html",
        nargs="?",
        const="",
        default=None,
        metavar="REPORT.html",
        help="write one self-contained HTML page (default: SWEEP/report.html, RUN/report/report.html)",
    )
    p.set_defaults(func=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    from everyprompt.data import DataError
    from everyprompt.models.io import ModelError
    from everyprompt.models.lora import LoRAError
    from everyprompt.models.precision import PrecisionError
    from everyprompt.processes import StopRequested
    from everyprompt.report import ReportError
    from everyprompt.rewards import RewardError
    from everyprompt.rollout import UnsupportedModelError
    from everyprompt.trainer import CheckpointError
    from everyprompt.trainer.learner import NumericsError

    parser = build_parser()
    # KEY=VALUE overrides may also follow the options (`filter data.jsonl --model M rl.seed=1`)
    args, unknown = parser.parse_known_args(argv)
    stray = [u for u in unknown if "=" not in u or u.startswith("-") or not hasattr(args, "config")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if unknown:
        args.config = [*args.config, *unknown]
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"everyprompt: config error: {err}", file=sys.stderr)
    except (
        DataError,
        ModelError,
        LoRAError,
        PrecisionError,
        RewardError,
        CheckpointError,
        ReportError,
        UnsupportedModelError,
    ) as err:
        print(f"everyprompt: {err}", file=sys.stderr)
    except (NumericsError, ClusterError) as err:  # not the user's input: the run itself went wrong
        print(f"everyprompt: {err}", file=sys.stderr)
        return EXIT_FAILURE
    except StopRequested as err:  # SIGINT / SIGTERM: stopped cleanly after a checkpoint
        print(f"everyprompt: {err}", file=sys.stderr)
        return err.exit_code
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
