"""A Ray session for one run: join `cluster.address`, or start a local instance that ends with the run.

A local instance started by `ray.init()` shares the fate of its driver only in part: killed with SIGKILL,
the driver takes the GCS and the raylet with it but leaves the raylet's agents running (seen with Ray
2.60). So a local session starts a reaper (`everyprompt.distributed.reaper`) in its own session, given
the processes `ray.init` started; it follows their descendants, waits for the driver to end, however it
ends, and then kills what is left of them.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

from everyprompt.config import ConfigError
from everyprompt.errors import ClusterError
from everyprompt.processes import descendants

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'everyprompt[ray]'"


def require_ray():
    """The `ray` module, or a ConfigError (the run asked for what is not installed) that says how to
    install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            f"config key 'cluster.backend': ray needs Ray, which is not installed here: {INSTALL_HINT}"
        ) from None
    return ray


def actor_options(cluster, **extra) -> dict:
    """Ray options of an actor: the configured per-actor resources."""
    return {"num_cpus": cluster.num_cpus, "num_gpus": cluster.num_gpus, **extra}


class RaySession:
    """Ray for one run. `actors` is how many actors the run will place, each asking for `cluster.num_cpus`
    CPUs: a local instance declares at least that many (Ray's CPUs are bookkeeping; on a small machine the
    actors share the cores), a joined cluster must have them or the run stops at once, not hangs."""

    def __init__(self, cluster, actors: int):
        ray = require_ray()
        self.ray, self.started, self.reaper = ray, False, None
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local, loopback-only instance
        if ray.is_initialized():  # the caller's own session (a script or a test that started Ray itself)
            self._check_resources(cluster, actors, "the running Ray session")
            return
        if cluster.address:
            ray.init(address=cluster.address, log_to_driver=True, configure_logging=False)
            self._check_resources(cluster, actors, f"the Ray cluster at cluster.address={cluster.address}")
            return
        cpus = max(os.cpu_count() or 1, int(round(actors * cluster.num_cpus + 0.4999)))
        began = time.perf_counter()
        before = set(descendants(os.getpid()))
        ray.init(
            num_cpus=cpus,
            include_dashboard=False,
            configure_logging=False,
            log_to_driver=True,
        )
        self.started = True
        self.reaper = _start_reaper(sorted(set(descendants(os.getpid())) - before))
        log.info("started a local Ray instance (%d CPUs) in %.1f s", cpus, time.perf_counter() - began)

    def _check_resources(self, cluster, actors: int, where: str) -> None:
        have = self.ray.cluster_resources()
        needs = {"CPU": actors * cluster.num_cpus, "GPU": actors * cluster.num_gpus}
        short = {k: v for k, v in needs.items() if v > have.get(k, 0.0) + 1e-9}
        if short:
            what = ", ".join(f"{v:g} {k}" for k, v in short.items())
            raise ClusterError(
                f"{where} has {have.get('CPU', 0):g} CPUs and "
                f"{have.get('GPU', 0):g} GPUs; {actors} actors at cluster.num_cpus={cluster.num_cpus:g}, "
                f"cluster.num_gpus={cluster.num_gpus:g} need {what}"
            )

    def close(self) -> None:
        """Shut down what this session started (a joined cluster keeps running)."""
        if self.started and self.ray.is_initialized():
            self.ray.shutdown()
        if self.reaper is not None:
            self.reaper.terminate()  # it sweeps the node's leftovers on its way out
            try:
                self.reaper.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.reaper.kill()
            self.reaper = None
        self.started = False


def _start_reaper(roots: list[int]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "everyprompt.distributed.reaper", str(os.getpid()), *map(str, roots)],
        start_new_session=True,  # not in the driver's process group: a Ctrl-C must not end it first
        stdin=subprocess.DEVNULL,
    )
