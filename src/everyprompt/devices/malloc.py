"""Which malloc a process runs on: glibc's, or tcmalloc or jemalloc preloaded (the config's `malloc`).

A library's malloc replaces glibc's only when the dynamic loader maps it before the program starts
(`LD_PRELOAD`), so a command that trains (`everyprompt train`, `demo`, `sft`) starts itself again with the
library preloaded when its config asks for one the process lacks (`use_malloc`); the processes it starts
(sweep cells, Ray workers, gloo ranks) inherit the variable. Within a running Python process, as when the
library is called from a script, nothing can change it: the run says which malloc it has.

Why: an RL step's heap fragments under glibc (blocks freed by a micro-batch's forward leave holes the
backward's tensors do not fit); tcmalloc's size classes do not: SmolLM2-135M's RL step at group size 16
peaked at 6.03 GiB resident on it against 7.73 on glibc's, 80.5 against 111.1 s a step, in one run of
each (docs/performance.md).
"""

from __future__ import annotations

import ctypes.util
import os
import sys

from everyprompt.errors import InputError, RunError

# name -> (the library as the loader finds it, the name ctypes.util.find_library takes, the Debian package)
MALLOCS: dict[str, tuple[str, str, str] | None] = {
    "glibc": None,
    "tcmalloc": ("libtcmalloc_minimal.so.4", "tcmalloc_minimal", "libtcmalloc-minimal4"),
    "jemalloc": ("libjemalloc.so.2", "jemalloc", "libjemalloc2"),
}
AUTO = "tcmalloc"  # what `auto` takes where it is installed, else glibc's
STARTED_FOR = "EVERYPROMPT_MALLOC"  # set on the restarted process: the malloc it was started for


def running_malloc() -> str:
    """The malloc this process runs on: a preloaded one of MALLOCS whose library is mapped, else glibc."""
    if not sys.platform.startswith("linux"):
        return "glibc"  # (the name stands for the platform's own malloc there)
    with open("/proc/self/maps") as maps:
        mapped = maps.read()
    return next((name for name, lib in MALLOCS.items() if lib and lib[0].split(".so")[0] in mapped), "glibc")


def installed(name: str) -> bool:
    """Whether the loader can find `name`'s library (glibc's is always there)."""
    lib = MALLOCS[name]
    return lib is None or ctypes.util.find_library(lib[1]) is not None


def wanted_malloc(choice: str) -> str:
    """The malloc the config's `malloc` asks for: `auto` is AUTO where installed, else glibc;
    a named one that is not installed is an InputError saying how to install it."""
    if choice == "auto":
        return AUTO if installed(AUTO) else "glibc"
    if choice not in MALLOCS:
        raise InputError(f"malloc: {choice!r} is not one of auto, {', '.join(MALLOCS)}")
    if not installed(choice):
        package = MALLOCS[choice][2]
        raise InputError(
            f"malloc: {choice}: its library ({MALLOCS[choice][0]}) is not installed; install it (Debian/Ubuntu: "
            f"apt-get install {package}) or set malloc: glibc"
        )
    return choice


def malloc_note(choice: str) -> str | None:
    """The line a run prints about its malloc: a preloaded one named; one the config names that this process
    lacks (a script calling the library, where nothing preloaded it); `auto` where nothing is installed."""
    wanted, running = wanted_malloc(choice), running_malloc()
    if wanted not in ("glibc", running):
        return (
            f"malloc: {choice} names {wanted}, and this process runs on {running}'s: a malloc is preloaded "
            f"when a process starts (the everyprompt command does it; a script: LD_PRELOAD={MALLOCS[wanted][0]})"
        )
    if running != "glibc":
        return f"malloc: {running} (preloaded)"
    if choice == "auto":
        library, _, package = MALLOCS[AUTO]
        return f"malloc: glibc's (auto: {library} is not installed; Debian/Ubuntu: apt-get install {package})"
    return None


def preloaded_environment(name: str) -> dict[str, str]:
    """This process's environment for a process that is to run on `name`'s malloc (an installed one of
    MALLOCS): its library first in LD_PRELOAD, and the name in STARTED_FOR."""
    lib = MALLOCS[name]
    if lib is None:
        return dict(os.environ)
    preload = " ".join(filter(None, [lib[0], os.environ.get("LD_PRELOAD", "")]))
    return {**os.environ, "LD_PRELOAD": preload, STARTED_FOR: name}


def use_malloc(choice: str) -> str:
    """Make this command's process run on the config's malloc: return its name where it already does,
    else start the command again (`os.execve`, the same arguments) with the library preloaded, which does
    not return. RunError where a process started for it still lacks it (the loader refused the library)."""
    wanted, running = wanted_malloc(choice), running_malloc()
    if wanted == running or wanted == "glibc":  # glibc's cannot be preloaded over another: keep what runs
        return running
    if os.environ.get(STARTED_FOR) == wanted:
        raise RunError(
            f"malloc: {wanted}: this process was started with {MALLOCS[wanted][0]} preloaded and runs on "
            f"{running}'s malloc; see the loader's message above, or set malloc: glibc"
        )
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], preloaded_environment(wanted))
    raise AssertionError("unreachable")  # pragma: no cover (execve does not return)
