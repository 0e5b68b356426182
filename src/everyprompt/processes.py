"""Child processes that end with the run: nothing a run starts outlives it, even a SIGKILL of the run.

A forked child holds copies of its parent's pipe ends, so it never sees its pipe close when the parent
dies; it has to be told. On Linux the kernel does it (`prctl(PR_SET_PDEATHSIG, SIGKILL)`: the child is
killed the moment the thread that forked it ends); elsewhere a daemon thread polls the parent's pid.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path

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


class StopRequested(Exception):  # noqa: N818  (a request, not an error)
    """SIGINT or SIGTERM asked the run to stop; it stopped cleanly after a checkpoint."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


class StoppedAtOnce(BaseException):  # noqa: N818  (a request, not an error; not caught by `except Exception`)
    """A signal asked the run to stop now: a second one during a step, or the first one where there is no
    step to finish (loading, evaluating). Its checkpoints are those already written."""

    def __init__(self, signum: int):
        super().__init__(f"stopped at once by {signal.Signals(signum).name}")
        self.signum = signum
        self.exit_code = 128 + signum


# what a run's children do with the signals a terminal, `timeout`, Slurm or `kill -- -PGID` send to the
# whole process group: nothing. The run decides (it finishes its step and stops them itself), and a run
# that dies takes them with it (die_with_parent)
GROUP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def ignore_group_signals() -> None:
    """Call first thing in a child process of a run: SIGINT and SIGTERM sent to the run's group do not end
    it (its parent stops it, or the kernel does when the parent dies)."""
    for signum in GROUP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


class _Handlers:
    """SIGINT and SIGTERM handled by `_handle` within the block, the previous handlers back after it (only
    the main thread may set handlers: elsewhere the block changes nothing)."""

    SIGNALS = GROUP_SIGNALS

    def __init__(self) -> None:
        self._previous: dict[int, object] = {}

    def _handle(self, signum, _frame) -> None:
        raise NotImplementedError

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


class StopAtOnce(_Handlers):
    """Within it, SIGINT / SIGTERM raise StoppedAtOnce in the main thread: where a command has no step to
    finish (loading a model, evaluating), it stops at once without a traceback. A GracefulStop inside it
    takes over while a loop runs."""

    def _handle(self, signum, _frame) -> None:
        raise StoppedAtOnce(signum)


class GracefulStop(_Handlers):
    """Within it, the first SIGINT / SIGTERM only sets `signum`: the loop finishes its step, writes a
    checkpoint and raises StopRequested. A second signal stops at once (StoppedAtOnce)."""

    def __init__(self) -> None:
        super().__init__()
        self.signum: int | None = None

    def _handle(self, signum, _frame) -> None:
        if self.signum is not None:  # asked twice: do not wait for the step
            raise StoppedAtOnce(signum)
        self.signum = signum
        print(
            f"\n{signal.Signals(signum).name}: stopping after this step (a checkpoint is written); "
            "send it again to stop at once",
            file=sys.stderr,
        )


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process, from /proc (Linux)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            table[int(entry.name)] = (int(fields[1]), fields[0])
    return table


def descendants(pid: int) -> set[int]:
    """Every live process whose parent chain leads to `pid` (zombies, already ended, left out)."""
    table = {p: parent for p, (parent, state) in _proc_table().items() if state != "Z"}
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in table.items() if parent in frontier} - found
        found |= frontier
    return found


def is_alive(pid: int) -> bool:
    """The process exists and has not ended (a zombie has)."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def first_line(process, timeout: float) -> str:
    """The first line `process` (a Popen with text stdout) prints, or "" if it prints none within
    `timeout` seconds; then it is killed: a server that hangs while loading must not hang its caller."""
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    if not ready:
        process.kill()
        return ""
    return process.stdout.readline()
