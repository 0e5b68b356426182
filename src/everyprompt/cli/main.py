"""The `everyprompt` parser, its dispatch, and the exit codes: 2 for bad input (one line naming the file,
key or value), 1 for a run that went wrong, 130 / 143 for a run stopped by a signal (after its step's
checkpoint, or at once where there was no step to finish or a second signal came), never a traceback."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys

from everyprompt.cli import data, models, report, runs, serve, start, sweep
from everyprompt.cli.args import EXIT_FAILURE, EXIT_USAGE, is_override
from everyprompt.config import ConfigError
from everyprompt.errors import InputError, RunError
from everyprompt.processes import StopAtOnce, StoppedAtOnce, StopRequested

COMMAND_GROUPS = (start, runs, data, models, sweep, report, serve)  # each adds its commands to the parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="everyprompt", description="RL post-training for reasoning models.")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in COMMAND_GROUPS:
        group.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # KEY=VALUE overrides may also follow the options (`filter data.jsonl --model M rl.seed=1`)
    args, unknown = parser.parse_known_args(argv)
    stray = [u for u in unknown if not is_override(u) or u.startswith("-") or not hasattr(args, "config")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if unknown:
        args.config = [*args.config, *unknown]
    # a signal where no loop is running stops at once; the loops (and serve, sweep) handle their own
    on_signal = contextlib.nullcontext() if getattr(args, "own_signals", False) else StopAtOnce()
    try:
        with on_signal:
            return args.func(args)
    except ConfigError as err:
        print(f"everyprompt: config error: {err}", file=sys.stderr)
    except InputError as err:  # a data file, model, checkpoint, reward, report input
        print(f"everyprompt: {err}", file=sys.stderr)
    except RunError as err:  # not the user's input: the run itself went wrong
        print(f"everyprompt: {err}", file=sys.stderr)
        return EXIT_FAILURE
    except StopRequested as err:  # SIGINT / SIGTERM: stopped cleanly after a checkpoint
        print(f"everyprompt: {err}", file=sys.stderr)
        return err.exit_code
    except StoppedAtOnce as err:  # no step to finish, or asked twice: what was written stays
        print(f"everyprompt: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:  # Ctrl-C before the handlers were set (while Python imports)
        print("everyprompt: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    return EXIT_USAGE
