"""`everyprompt demo | train | sft | eval`: the commands that train or evaluate a model."""

from __future__ import annotations

import sys

from everyprompt.cli.args import add_config_argument, config_from, split_config_args
from everyprompt.config import GYM_PREFIX, ConfigError, gym_overrides, load_config
from everyprompt.devices.malloc import use_malloc
from everyprompt.run.layout import RunLayout, run_of


def _on_its_malloc(config):
    """The config, once this process runs on the malloc it names (else the command starts again with it
    preloaded: devices/malloc.py)."""
    use_malloc(config.malloc)
    return config


# Each command reads its config before it imports the pipeline (torch, transformers: seconds), so a
# config error answers at once.


def cmd_demo(args) -> int:
    config = _on_its_malloc(config_from(args.config, [f"seed={args.seed}"] if args.seed is not None else []))
    from everyprompt.pipeline import demo

    demo(config, args.run_dir)
    return 0


def cmd_train(args) -> int:
    if args.resume:
        saved = RunLayout(args.resume).config
        if not saved.is_file():
            raise ConfigError(f"--resume {args.resume}: no {saved.name} there; is it a run directory?")
        config = _on_its_malloc(load_config(saved, split_config_args(args.config)[1]))
    else:
        config = _on_its_malloc(config_from(args.config))
    from everyprompt.pipeline import train

    train(config, run_dir=args.resume or args.run_dir, resume=bool(args.resume))
    return 0


def cmd_sft(args) -> int:
    config = _on_its_malloc(config_from(args.config))
    from everyprompt.pipeline import warm_start

    warm_start(config, args.run_dir)
    return 0


def cmd_eval(args) -> int:
    from rich.console import Console

    from everyprompt.report.console import eval_table

    data, values = args.data, list(args.config)
    if data is not None and data.startswith(GYM_PREFIX):  # reasoning-gym's tasks, their held-out items
        data, values = None, [*values, *gym_overrides(data)]
    config = _eval_config(args.checkpoint, values)
    given = {"prompt": args.prompt_field, "answer": args.answer_field}
    fields = {field: name for field, name in given.items() if name}
    from everyprompt.pipeline import evaluate_checkpoint

    results = evaluate_checkpoint(config, args.checkpoint, data, fields, args.run_dir)
    Console().print(eval_table(results, config.eval.pass_k))
    return 0


def _eval_config(checkpoint: str, values: list[str]):
    """The config an evaluation runs with: a run's own `config.yaml` (its data, prompt format, reward and
    generation) when CHECKPOINT belongs to a run and no config file is given, the overrides on top; else
    the given file (or the embedded default) with the overrides."""
    path, overrides = split_config_args(values)
    run = run_of(checkpoint) if path is None else None
    if run is None:
        return load_config(path, overrides)
    print(f"config: {run.config} (the run's own), then the command line's overrides", file=sys.stderr)
    return load_config(run.config, overrides)


def add_parsers(sub) -> None:
    p = sub.add_parser("demo", help="SFT warm start, RL and held-out eval of a tiny MoE on CPU")
    add_config_argument(p)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--run-dir", default=None)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("train", help="SFT warm start (if configured) then RL")
    add_config_argument(p, "CONFIG.yaml (default: the demo config), then KEY=VALUE overrides")
    p.add_argument("--run-dir", default=None)
    p.add_argument(
        "--resume", default=None, metavar="RUN_DIR", help="continue a run from its latest checkpoint"
    )
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("sft", help="supervised warm start on worked solutions")
    add_config_argument(p)
    p.add_argument("--run-dir", default=None)
    p.set_defaults(func=cmd_sft)

    p = sub.add_parser("eval", help="greedy pass@1 and sampled pass@k of a checkpoint")
    p.add_argument("checkpoint", help="checkpoint directory, run directory or .gguf file")
    add_config_argument(
        p, "optional CONFIG.yaml (default: the run's own config.yaml, else the demo config), then KEY=VALUE"
    )
    p.add_argument(
        "--data",
        default=None,
        help="a data file with prompt and answer columns (as data.train_file), or reasoning-gym:TASK[@LEVEL],... "
        "(the held-out items of those tasks)",
    )
    p.add_argument("--prompt-field", default=None, help="the prompt's column (default: data.columns.prompt)")
    p.add_argument("--answer-field", default=None, help="the answer's column (default: data.columns.answer)")
    p.add_argument("--run-dir", default=None, help="where eval.json goes (default: CHECKPOINT/eval)")
    p.set_defaults(func=cmd_eval)
