"""Torch's CPU threads fitted to the cores other processes leave free, phase by phase.

torch runs each operator's work split evenly over its threads (OpenMP), and every operator ends at a
barrier: the operator takes as long as its slowest thread. When another process holds one of the cores,
one of torch's threads shares a core with it and runs only part of the time, so every operator waits for
it; a decode step is thousands of small operators, each paying a scheduler slice. On 2 cores beside one
busy process the smollm2 recipe's step ran about 10x its quiet time with 2 threads; the same operators on
1 thread run at about their quiet speed (bench/learner/contention.py measures both).

`CoreShare.fit()`, called where a phase starts (the trainer: before the rollout and before the update), sets
torch's thread count to the cores the other processes left over during the phase before: how much of the
machine was busy (/proc/stat) minus what this process used (/proc/self/stat), over the wall time between
the two calls. Only on Linux (elsewhere it keeps the threads it was given); never above the threads the run
started with. A setting of its own: `cpu_threads: adaptive` (the default) or `fixed`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

# a core counts as free when the others used less than this share of it (below: 2 threads beside a process
# that takes 0.6 of a core or more lose to 1 thread)
SPARE = 0.4
WINDOW_S = 0.25  # the shortest phase measured (the first fit waits for one)


def _busy_ticks() -> int | None:
    """Clock ticks every CPU spent busy since boot (user, nice, system, irq, softirq, steal), or None."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return user + nice + system + irq + softirq + steal


def _own_ticks() -> int | None:
    """Clock ticks this process (all its threads) spent on a CPU, or None."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])  # utime, stime


@dataclass
class _Sample:
    wall: float
    busy: int
    own: int


class CoreShare:
    """Fits torch's threads to the free cores at each `fit()`; `limit`: the most threads (the run's)."""

    def __init__(self, limit: int, cores: int | None = None):
        self.limit = max(1, limit)
        self.cores = cores or os.cpu_count() or 1
        self.ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.others = 0.0  # the cores other processes used during the last phase
        self.measured = False
        self._last = self._sample()

    def _sample(self) -> _Sample | None:
        busy, own = _busy_ticks(), _own_ticks()
        return None if busy is None or own is None else _Sample(time.perf_counter(), busy, own)

    def measure(self) -> float:
        """The cores other processes used since the last call (0 where /proc cannot be read)."""
        now = self._sample()
        if now is None or self._last is None:
            return 0.0
        seconds = now.wall - self._last.wall
        if seconds < WINDOW_S:  # too short to tell (a tick is 10 ms): the first call waits out a window
            if self.measured:
                return self.others
            time.sleep(WINDOW_S - seconds)
            now = self._sample()
            seconds = now.wall - self._last.wall
        self.measured = True
        other_ticks = (now.busy - self._last.busy) - (now.own - self._last.own)
        self._last = now
        self.others = max(0.0, other_ticks / self.ticks / seconds)
        return self.others

    def threads(self, others: float) -> int:
        """The threads to run beside `others` cores' worth of other work."""
        return max(1, min(self.limit, int(self.cores - others + SPARE)))

    def fit(self) -> int:
        """Set torch's threads (in the calling thread) for the free cores; returns the count."""
        import torch

        if self.limit == 1:  # nothing to fit: no measuring, no first window's wait
            return 1
        wanted = self.threads(self.measure())
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
        return wanted
