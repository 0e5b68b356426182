"""`everyprompt score | filter`: the commands that work on data files."""

from __future__ import annotations

import sys

from everyprompt.cli.args import add_config_argument, config_from
from everyprompt.config import GYM_PREFIX, gym_overrides


def cmd_score(args) -> int:
    from everyprompt.rewards.files import score_file

    scored = score_file(args.input, args.reward, args.completion_field, args.answer_field, args.output)
    failures = sum(count for count, _ in scored.failures.values())
    print(f"scored {scored.rows} rows: mean reward {scored.mean:.4f}, {failures} errors", file=sys.stderr)
    for summary, (count, first) in scored.failures.items():
        print(f"  {count} x {summary}\n{first.traceback}", file=sys.stderr)
    return 0


def cmd_filter(args) -> int:
    """ZVE stage 0: estimate each prompt's pass rate with K samples; keep low < p < high."""
    from rich.console import Console

    from everyprompt.pipeline import filter_prompts
    from everyprompt.report.console import histogram_table, level_table

    extra = [
        f"zve.filter.{key}={value}"
        for key in ("samples", "low", "high")
        if (value := getattr(args, key)) is not None
    ]
    data, out = args.data, args.out
    if data.startswith(GYM_PREFIX):  # reasoning-gym's tasks: the training items the config makes of them
        data, extra, out = "builtin", [*extra, *gym_overrides(data, "DATA")], out or "reasoning-gym-filtered"
    config = config_from(args.config, extra)
    rules = config.zve.filter
    done = filter_prompts(config, data, args.model, out)
    report = done.report
    console = Console()
    console.print(histogram_table(report["histogram"], report["prompts"], rules.samples))
    if report["by_level"]:
        console.print(level_table(report["by_level"], tuple(report["band"])))
    console.print(
        f"kept {report['kept']} (low < p < high: {rules.low:g} < p < {rules.high:g}); dropped "
        f"{report['too_easy']} too easy, {report['too_hard']} too hard, {report['unscored']} unscored\n"
        f"wrote {done.out.root}/{done.out.names()}"
    )
    return 0


def add_parsers(sub) -> None:
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
    p.add_argument(
        "data",
        help="JSONL/Parquet prompts (prompt, answer), 'builtin' for the config's task, or "
        "reasoning-gym:TASK[@LEVEL],... (those tasks' training items)",
    )
    add_config_argument(p)
    p.add_argument("--model", required=True, help="checkpoint directory or run directory")
    p.add_argument("--samples", type=int, default=None, help="samples per prompt (zve.filter.samples)")
    p.add_argument("--low", type=float, default=None, help="drop p <= low (zve.filter.low)")
    p.add_argument("--high", type=float, default=None, help="drop p >= high (zve.filter.high)")
    p.add_argument("--out", default=None, help="output directory (default: DATA-filtered)")
    p.set_defaults(func=cmd_filter)
