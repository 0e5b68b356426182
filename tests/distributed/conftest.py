"""A local Ray instance (2 CPUs) for the tests of this folder, started once and shut down after them;
nothing of it may outlive the tests."""

from __future__ import annotations

import os
import time

import pytest


@pytest.fixture(scope="package")
def ray_instance():
    ray = pytest.importorskip("ray", reason="the ray extra is not installed (it is part of dev)")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    node = ray.get_runtime_context().get_node_id()
    yield ray
    ray.shutdown()
    from everyprompt.distributed.reaper import node_processes

    deadline = time.monotonic() + 15
    while node_processes(node) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert node_processes(node) == [], "processes of the test's Ray instance outlived ray.shutdown()"


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
