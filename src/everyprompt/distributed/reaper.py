"""`python -m everyprompt.distributed.reaper DRIVER_PID NODE_ID`: wait for the driver process to end (or
for SIGTERM), then kill every process of the local Ray node NODE_ID (Ray marks its processes with
RAY_NODE_ID in their environment). Linux only (/proc); elsewhere it only waits."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


def node_processes(node_id: str) -> list[int]:
    """Processes whose environment names Ray node `node_id`, other than this one."""
    marker = f"RAY_NODE_ID={node_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return found


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def sweep(node_id: str) -> int:
    killed = 0
    for pid in node_processes(node_id):
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except OSError:
            pass
    return killed


def main(argv: list[str]) -> int:
    driver, node_id = int(argv[0]), argv[1]
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while not stopping and alive(driver):
        time.sleep(0.5)
    if Path("/proc").is_dir():
        time.sleep(0.5 if stopping else 0.0)  # after a clean shutdown: let Ray's own exits finish first
        sweep(node_id)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
