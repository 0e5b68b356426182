"""The training clock of a C7 run and the snapshots taken at its marks, alike for every arm: seconds since
the first step started, less the time spent writing snapshots; a snapshot is the policy after the first
step that ends at or past a mark, and the run ends with the step that reaches the last mark (the budget)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path


class TrainingClock:
    """Seconds of training since `start()`, less the time spent inside `paused()`."""

    def __init__(self, now: Callable[[], float] = time.perf_counter):
        self.now, self.started, self.paused_s = now, None, 0.0

    def start(self) -> None:
        self.started, self.paused_s = self.now(), 0.0

    def elapsed(self) -> float:
        if self.started is None:
            raise RuntimeError("the training clock was read before the first step started")
        return self.now() - self.started - self.paused_s

    @contextlib.contextmanager
    def paused(self):
        began = self.now()
        try:
            yield
        finally:
            self.paused_s += self.now() - began


@dataclass
class Snapshots:
    """The policy's weights at the clock's `marks` (seconds, ascending; the last is the budget), written by
    `save(directory)` under `root`: one snapshot for every mark a step's end passed (a step that passes two
    marks serves both)."""

    clock: TrainingClock
    marks: Sequence[float]
    root: Path
    save: Callable[[Path], None]
    taken: list[dict] = field(default_factory=list)  # {mark_s, step, clock_s, dir} per mark

    def __post_init__(self):
        if not self.marks or list(self.marks) != sorted(set(self.marks)) or self.marks[0] <= 0:
            raise ValueError(f"marks must be positive seconds in ascending order, got {list(self.marks)}")

    @property
    def budget(self) -> float:
        return self.marks[-1]

    def after_step(self, step: int) -> bool:
        """Step `step` has ended: a snapshot if it passed marks not yet taken; True once the budget is spent."""
        elapsed = self.clock.elapsed()
        due = [m for m in self.marks[len(self.taken) :] if elapsed >= m]
        if due:
            directory = self.root / f"step_{step}"
            with self.clock.paused():
                self.save(directory)
            self.taken += [{"mark_s": m, "step": step, "clock_s": elapsed, "dir": directory} for m in due]
        return len(self.taken) == len(self.marks)
