"""Child processes that end with the run: nothing a run starts outlives it, even a SIGKILL of the run.

A forked child holds copies of its parent's pipe ends, so it never sees its pipe close when the parent
dies; it has to be told. On Linux the kernel does it (`prctl(PR_SET_PDEATHSIG, SIGKILL)`: the child is
killed the moment the thread that forked it ends); elsewhere a daemon thread polls the parent's pid.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int, poll_s: float = 1.0) -> None:
    """Call first thing in a child process: it is killed when process `parent_pid` (its parent) dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    else:
        threading.Thread(target=_watch_parent, args=(parent_pid, poll_s), daemon=True).start()
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)


def _watch_parent(parent_pid: int, poll_s: float) -> None:
    while os.getppid() == parent_pid:
        time.sleep(poll_s)
    os._exit(1)
