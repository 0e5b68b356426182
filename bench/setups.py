"""Shared by the benchmarks that measure each set-up in a fresh process of its own: run this module again
with `--one NAME` per set-up and collect the JSON line each prints last."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.common import bench_process


def measure_each(script: str, names: list[str], extra: list[str], timeout_s: float = 900) -> dict[str, dict]:
    """`python -m bench.SCRIPT --one NAME *extra` for each name, in order; each run's last stdout line as
    JSON."""
    results = {}
    for name in names:
        command, env = bench_process(script, "--one", name, *extra)
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, check=False, env=env
        )
        if done.returncode != 0:
            raise RuntimeError(f"set-up {name!r} failed:\n{done.stderr[-4000:]}")
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{name}: {results[name]}", file=sys.stderr)
    return results
