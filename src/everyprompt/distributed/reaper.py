"""`python -m everyprompt.distributed.reaper DRIVER_PID ROOT_PID...`: while the driver runs, keep track of the
roots (the processes the driver's `ray.init` started: its local Ray instance's servers) and every process
descended from them (agents, workers); when the driver ends, however it ends, or when told to stop
(SIGTERM), kill those still running. The driver's other children are not touched.

Tracking the tree while the driver lives is what makes this work after a SIGKILL: Ray's processes are
then re-parented to init and nothing marks them as this run's any more (their environment does not, in
every set-up). A process is known by its pid and its start time, so a pid the system reused for an
unrelated process is never killed. Linux only (/proc); elsewhere it only waits.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from everyprompt.processes import descendants, is_alive

POLL_S = 0.25


def _start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), or None when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def tracked(roots: list[int]) -> dict[int, int]:
    """The live roots and their live descendants: pid -> start time."""
    pids = set(roots).union(*(descendants(root) for root in roots))
    return {pid: started for pid in pids if (started := _start_time(pid)) is not None}


def sweep(known: dict[int, int]) -> int:
    """Kill each known process still running as itself (same start time); how many were killed."""
    killed = 0
    for pid, started in known.items():
        if _start_time(pid) != started or pid == os.getpid():
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except OSError:
            pass
    return killed


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def main(argv: list[str]) -> int:
    driver, roots = int(argv[0]), [int(pid) for pid in argv[1:]]
    stopping: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not Path("/proc").is_dir():
        while not stopping and _exists(driver):
            time.sleep(1.0)
        return 0
    known: dict[int, int] = {}
    while not stopping and is_alive(driver):
        known.update(tracked(roots))
        time.sleep(POLL_S)
    if stopping:  # a clean shutdown: let Ray's own exits finish first
        time.sleep(0.5)
    sweep(known)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
