"""A local Ray instance (2 CPUs) for the tests of this folder, started once and shut down after them;
nothing of it may outlive the tests."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from everyprompt.processes import descendants

ROOT = Path(__file__).resolve().parents[2]

# for tests that start Ray in a child process (the `ray_instance` fixture skips by itself)
needs_ray = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="the ray extra is not installed (it is part of dev)"
)


@pytest.fixture(scope="package")
def ray_instance():
    ray = pytest.importorskip("ray", reason="the ray extra is not installed (it is part of dev)")
    from everyprompt.distributed.reaper import tracked
    from everyprompt.processes import descendants

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    before = descendants(os.getpid())
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    roots = sorted(descendants(os.getpid()) - before)  # Ray's servers, started by ray.init
    yield ray
    started = tracked(roots)  # the servers and what they started: agents, workers
    ray.shutdown()
    deadline = time.monotonic() + 15
    while tracked(list(started)) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = tracked(list(started))
    assert {p: t for p, t in left.items() if started.get(p) == t} == {}, (
        "Ray processes outlived ray.shutdown()"
    )


def actor_processes(name: str) -> list[int]:
    """Live processes titled as a Ray actor of class `name` (ray::Name...)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if f.read().startswith(f"ray::{name}".encode()):
                        found.append(int(entry.name))
            except OSError:
                continue
    return found


def actors_left(*names: str, wait_s: float = 30.0) -> list[int]:
    """The processes of actors of classes `names` still alive after up to `wait_s` seconds (a killed
    actor's process exits shortly after the kill returns)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = [pid for name in names for pid in actor_processes(name)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)


def run_ray_bench(module: str, out: Path, timeout_s: float = 600) -> dict:
    """`python -m <module> --tiny --out <out>` from the repository, in a process of its own that starts and
    ends its own Ray instance; its results. Fails if it fails, or if a Ray process it started outlives it
    (this process's own Ray instance, whose workers start as tests need them, is not counted)."""
    from tests.distributed.test_cli_ray import _alive, _ray_processes

    before = _ray_processes()
    done = subprocess.run(
        [sys.executable, "-m", module, "--tiny", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    own = descendants(os.getpid())
    started = {pid: t for pid, t in _ray_processes().items() if before.get(pid) != t and pid not in own}
    deadline = time.monotonic() + 15  # a process ray.shutdown stopped exits shortly after
    while _alive(started) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _alive(started), f"{module}'s Ray processes outlived it"
    return json.loads(out.read_text())
