"""What the benchmarks share: where results go, timing, the machine they ran on, and writing results.

Every results JSON records the machine (cores, torch threads, torch version, dtype where it applies) and
names files by paths relative to the repository."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from everyprompt.run.files import write_text_atomic
from everyprompt.run.machine import machine

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def best_of(repeats: int, fn) -> tuple[float, object]:
    """The fastest of `repeats` timed calls (the first also warms caches up), with its result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        out = fn()
        elapsed = time.perf_counter() - started
        if elapsed < best:
            best, result = elapsed, out
    return best, result


def repo_path(path: str | Path) -> str:
    """`path` relative to the repository it lies in (results JSON name no machine paths): this one, or the
    checkout a bench run from another copy of the tree wrote into (`--out`); unchanged outside any."""
    path = Path(path).resolve()
    root = next(
        (d for d in (ROOT, *path.parents) if path.is_relative_to(d) and (d == ROOT or (d / ".git").exists())),
        None,
    )
    return str(path.relative_to(root)) if root is not None else str(path)


def repo_override(override: str) -> str:
    """A KEY=VALUE override with a path value written as `repo_path` writes it."""
    key, sep, value = override.partition("=")
    return f"{key}={repo_path(value)}" if sep and value.startswith("/") else override


def write_results(path: Path, payload: dict, dtype: str | None = None) -> Path:
    """Write `payload` with the machine described, as JSON (creating the folder), atomically: a kill leaves
    the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({**payload, "machine": machine(dtype)}, indent=1, default=str))
    return path


class ProbeFailed(RuntimeError):
    """A probe process that did not finish (`how`: its exit status or the signal that killed it)."""

    def __init__(self, message: str, how: str):
        super().__init__(message)
        self.how = how


def module_of(script: str | Path) -> str:
    """The module `python -m` runs a file of bench/ as (`bench/learner/rl_step.py`: bench.learner.rl_step; a package's
    `__main__.py`: the package)."""
    path = Path(script).resolve().relative_to(ROOT).with_suffix("")
    return ".".join(path.parts[:-1] if path.name == "__main__" else path.parts)


def bench_process(script: str | Path, *arguments: str, env: dict | None = None) -> tuple[list[str], dict]:
    """The command and environment that run a file of bench/ in a process of its own, as a module, from
    any working directory (the checkout on its PYTHONPATH); a file elsewhere runs as the script it is."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if not Path(script).resolve().is_relative_to(ROOT / "bench"):
        return [sys.executable, str(script), *arguments], env
    return [sys.executable, "-m", module_of(script), *arguments], env


def run_probe(script: str | Path, flag: str, arguments: list, env: dict | None = None) -> dict:
    """Run `script flag JSON(arguments)` in a fresh Python process (a measurement that needs a process
    of its own: peak memory, a cold cache) and return the JSON its last line of output prints."""
    command, env = bench_process(script, flag, json.dumps(arguments, default=str), env=env)
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        how = f"killed by signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
        raise ProbeFailed(
            f"{Path(script).name} {flag} {arguments} failed ({how}):\n{done.stderr[-4000:]}", how
        )
    if done.stderr.strip():  # what the probe warned of (a CUDA-graph capture that failed, say) is shown
        sys.stderr.write(done.stderr[-4000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def recipe_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments every RL-recipe bench takes: `--model` (a directory or `.gguf`), `--config` (the
    recipe, configs/smollm2.yaml by default), `--set` (a config override, repeatable), `--out`."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2.yaml")
    parser.add_argument("--set", action="append", default=[], help="a config override (repeatable)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser


def parse_probing(
    parser: argparse.ArgumentParser, argv: list[str] | None, probe
) -> argparse.Namespace | None:
    """A model-taking bench's arguments. Called as its own probe process (`run_probe`'s `--probe JSON`):
    runs `probe(*arguments)`, prints its JSON and returns None. Otherwise the arguments, once `--model`
    names something that exists (a usage error, exit 2, if not)."""
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(probe(*json.loads(args.probe))))
        return None
    return require_model(parser, args)


def require_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """`args`, once `--model` names something that exists (a usage error, exit 2, if not)."""
    if args.model is None or not args.model.exists():
        parser.error(f"--model {args.model}: no such file or directory")
    return args
