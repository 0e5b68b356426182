"""RewardPool: reward functions in worker processes, fed one completion at a time as the engine streams
them out, so that scoring overlaps with generation (docs/rollout.md).

A worker is sent up to `batch_size` waiting completions per call (the reward function's own
`batch_size` attribute by default, 1 without one: a judge model decodes a batch at once). Each call has a
time limit: a worker that hangs past `timeout_s` or dies (a crash, a segfault in a native verifier) is
killed and replaced, and its completions get reward None and a counted error; the run never waits on it.
A worker that crashes (dies, not a timeout) may have died of something else than its completions (killed
by the kernel's OOM killer, a lost machine): its completions are sent once more, to the new worker, and
score None only if they crash that one too. A reward with a `prepare()` method (a judge loading its model) runs it once per worker before its first
call, under its own limit `load_timeout_s`, not the per-call one; a reward that cannot load stops the run
(`wait` raises RewardError) rather than being retried forever. A row that cannot be scored (the function raises, returns a non-number or the wrong number of
values) gets None and a `RewardFailure`; `take_failures()` hands them to the caller, which reports each
distinct one once and decides whether the run can go on.

Workers are forked, so a reward registered by the user's own script before the run is known to them. With
`workers=0` scoring runs inline in the calling process, when `wait` is called, in one call of the reward
function over everything submitted since (no overlap, no time limit; a batched judge sees the batch).
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from everyprompt.processes import die_with_parent, ignore_group_signals
from everyprompt.rewards.base import RewardError, RewardFailure, get_reward, reward_columns, score_completions

# a worker's first message: (READY, None) once the reward's prepare() finished, or (FAILED, why)
READY, FAILED = "ready", "failed"


def _serve(conn: Connection, fn: Callable, parent_pid: int) -> None:
    """Worker loop: first READY (or a load failure), then [(key, completion, row), ...] in and
    ([(key, (reward, components)), ...], failures) out."""
    ignore_group_signals()  # Ctrl-C, `timeout` or Slurm signal the whole group: the run decides
    die_with_parent(parent_pid)  # a killed run leaves no reward worker behind
    if "torch" in sys.modules:
        # torch's intra-op thread pool does not survive fork: a forked child that runs a parallel op
        # with the parent's thread count hangs (seen with torch 2.13). One thread per worker, as
        # DataLoader workers do.
        sys.modules["torch"].set_num_threads(1)
    prepare = getattr(fn, "prepare", None)
    try:
        if prepare is not None:
            prepare()
    except Exception as err:  # noqa: BLE001  (user code: reported to the run, which stops)
        conn.send((FAILED, RewardFailure.from_exception(err).summary))
        return
    conn.send((READY, None))
    while True:
        try:
            tasks = conn.recv()
        except EOFError:
            return
        if tasks is None:
            return
        rewards, components, failures = score_rows(fn, [t[1] for t in tasks], [t[2] for t in tasks])
        conn.send(([(t[0], (r, c)) for t, r, c in zip(tasks, rewards, components)], failures))


def score_rows(
    fn: Callable, completions: list[str], rows: list[dict]
) -> tuple[list[float | None], list[dict | None], list[RewardFailure]]:
    """Rewards of `completions` in one call, their components (rewards with `score_with_components`,
    else None per row) and the failures of the rows that could not be scored, as in
    `score_completions`."""
    columns = reward_columns(rows)
    if not hasattr(fn, "score_with_components"):
        rewards, failures = score_completions(fn, completions, columns)
        return rewards, [None] * len(completions), failures
    try:
        totals, components, failures = fn.score_with_components(completions, **columns)
    except Exception as err:  # noqa: BLE001  (user code: isolate, count, keep going)
        return (
            [None] * len(completions),
            [None] * len(completions),
            [RewardFailure.from_exception(err)] * len(completions),
        )
    if isinstance(failures, int):  # a count without details
        failures = [RewardFailure(f"{type(fn).__name__}.score_with_components: a row failed")] * failures
    return totals, components, failures


@dataclass
class _Worker:
    process: Any
    conn: Connection
    started: float  # when it was started (while loading) or sent its current call
    tasks: list | None = None  # the call in flight
    ready: bool = False  # its reward's prepare() finished


@dataclass
class PoolStats:
    submitted: int = 0
    scored: int = 0
    errors: int = 0  # rows scored None by a raising reward, a timeout or a crash
    timeouts: int = 0
    crashes: int = 0
    restarts: int = 0


class RewardPool:
    """`submit(key, completion, row)` without blocking; `wait(keys)` for their rewards (float or None).

    The workers stop at `close()`, or when the pool is garbage-collected."""

    def __init__(
        self,
        spec: str | Callable,
        workers: int = 1,
        timeout_s: float = 30.0,
        batch_size: int | None = None,
        load_timeout_s: float = 600.0,
    ):
        if workers < 0:
            raise ValueError(f"rewards.workers must be >= 0, got {workers}")
        for key, value in (("timeout_s", timeout_s), ("load_timeout_s", load_timeout_s)):
            if not value > 0:
                raise ValueError(f"rewards.{key} must be > 0, got {value}")
        # an unknown name fails here, in the caller, with the registry's message; forked workers inherit fn
        fn = spec if callable(spec) else get_reward(spec)
        batch_size = batch_size if batch_size is not None else int(getattr(fn, "batch_size", 1))
        if batch_size < 1:
            raise ValueError(f"reward batch_size must be >= 1, got {batch_size}")
        self._inline = fn if workers == 0 else None
        self._pending: list[tuple[Any, str, dict]] = []  # inline: submitted, not yet scored
        self._state = _Dispatcher(fn, workers, float(timeout_s), batch_size, float(load_timeout_s))
        self.stats = self._state.stats
        self.last_components: list[dict | None] = []
        if workers:
            self._thread = threading.Thread(target=self._state.run, name="reward-pool", daemon=True)
            self._thread.start()
        self._finalizer = weakref.finalize(self, self._state.stop)

    def submit(self, key: Any, completion: str, row: dict) -> None:
        self.stats.submitted += 1
        if self._inline is not None:
            self._pending.append((key, completion, row))
        else:
            self._state.put((key, completion, row))

    def wait(self, keys: list) -> list[float | None]:
        """Rewards for `keys` in that order, once all are in (each call is bounded by the timeout).
        `last_components` then holds each one's component values (composite rewards; else None)."""
        state = self._state
        if self._pending:  # inline: everything submitted so far, in one reward call
            pending, self._pending = self._pending, []
            rewards, components, failures = score_rows(
                self._inline, [c for _, c, _ in pending], [row for _, _, row in pending]
            )
            for (key, _, _), reward, parts in zip(pending, rewards, components):
                state.finish(key, (reward, parts), [])
            state.record_failures(failures)
        with state.done:
            while True:
                if state.fatal is not None:
                    raise RewardError(state.fatal)
                missing = [key for key in keys if key not in state.results]
                if not missing:
                    scored = [state.results.pop(key) for key in keys]
                    self.last_components = [components for _, components in scored]
                    return [reward for reward, _ in scored]
                if self._inline is not None:
                    raise KeyError(f"wait() for rewards never submitted: {missing[:3]}")
                if not self._thread.is_alive():  # nothing will score them: say so rather than wait forever
                    raise RewardError(
                        f"the reward pool's dispatcher ended with {len(missing)} rewards unscored"
                    )
                state.done.wait(timeout=0.5)

    def take_failures(self) -> list[RewardFailure]:
        """The failures recorded since the last call (timeouts and crashed workers included)."""
        with self._state.done:
            failures, self._state.failures = self._state.failures, []
        return failures

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Dispatcher:
    """The pool's worker processes and the thread loop that feeds them (holds no reference to the pool,
    so that a pool nobody holds is collected and its workers stopped)."""

    def __init__(self, fn: Callable, workers: int, timeout_s: float, batch_size: int, load_timeout_s: float):
        self.fn, self.timeout_s = fn, timeout_s
        self.batch_size, self.load_timeout_s = batch_size, load_timeout_s
        self.fatal: str | None = None  # why the reward cannot run at all (it failed to load)
        self.stats = PoolStats()
        self.results: dict[Any, tuple] = {}  # key -> (reward, components)
        self.failures: list[RewardFailure] = []  # since the pool's last take_failures()
        self.done = threading.Condition()
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.backlog: deque = deque()  # tasks waiting for a free worker (the dispatcher thread's)
        self.retried: set = set()  # keys sent again after their worker crashed (not sent a third time)
        # a byte per submitted task wakes the dispatcher, which otherwise sleeps until a worker answers
        # or the earliest call's deadline (no polling: on a small machine it would slow the engine)
        self.wake_read, self.wake_write = os.pipe() if workers else (-1, -1)
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        self.context = multiprocessing.get_context(method)
        self.workers = [self.start() for _ in range(workers)]
        self.stopped = False

    def start(self) -> _Worker:
        parent, child = self.context.Pipe()
        process = self.context.Process(target=_serve, args=(child, self.fn, os.getpid()), daemon=True)
        process.start()
        child.close()
        return _Worker(process, parent, time.perf_counter())

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        try:
            self.put(None)
        except OSError:  # the dispatcher has ended already and closed its end of the wake pipe
            pass
        # the write end is closed here, after the last write, and never written again (a closed fd's number
        # may be another file's by then); the dispatcher closes the read end when it ends
        if self.wake_write >= 0:
            os.close(self.wake_write)
            self.wake_write = -1
        for worker in self.workers:
            try:
                worker.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            worker.process.join(timeout=1)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()

    def finish(self, key: Any, reward: tuple, failures: list[RewardFailure]) -> None:
        """Record `reward` = (value, components) for `key`, and the failures of its scoring."""
        with self.done:
            self.stats.scored += 1
            self.results[key] = reward
            self.record_failures(failures)
            self.done.notify_all()

    def record_failures(self, failures: list[RewardFailure]) -> None:
        with self.done:
            self.stats.errors += len(failures)
            self.failures.extend(failures)

    def replace(self, index: int, why: str, retry: bool = False) -> None:
        """A new worker in place of worker `index`. Its unfinished tasks score None with a failure, or, with
        `retry` (it crashed), go back to the head of the queue once."""
        worker = self.workers[index]
        worker.process.kill()
        worker.process.join()
        worker.conn.close()
        self.stats.restarts += 1
        self.workers[index] = self.start()
        failure = RewardFailure(f"reward call {why}; the worker was replaced")
        tasks = worker.tasks or []
        again = [task for task in tasks if retry and task[0] not in self.retried]
        for task in reversed(again):
            self.retried.add(task[0])
            self.backlog.appendleft(task)
        for task in tasks:
            if not (retry and task in again):
                self.finish(task[0], (None, None), [failure])

    def give_up(self, why: str) -> None:
        """The reward cannot run: every waiter is woken to raise RewardError(why)."""
        with self.done:
            self.fatal = why
            self.done.notify_all()

    def deadline(self, worker: _Worker) -> float:
        limit = self.timeout_s if worker.ready else self.load_timeout_s
        return worker.started + limit

    def put(self, task) -> None:
        self.tasks.put(task)
        if self.wake_write >= 0:
            os.write(self.wake_write, b"x")

    def run(self) -> None:
        backlog = self.backlog
        try:
            while True:
                try:
                    while True:
                        task = self.tasks.get_nowait()
                        if task is None:
                            return
                        backlog.append(task)
                except queue.Empty:
                    pass
                if self.fatal is not None:  # the reward cannot run: send nothing more, wait for stop()
                    wait([self.wake_read])
                    os.read(self.wake_read, 4096)
                    continue
                for index, worker in enumerate(list(self.workers)):
                    if worker.ready and worker.tasks is None and backlog:
                        worker.tasks = [backlog.popleft() for _ in range(min(self.batch_size, len(backlog)))]
                        worker.started = time.perf_counter()
                        try:
                            worker.conn.send(worker.tasks)
                        except OSError:  # it died since it last answered: its tasks go to a new worker
                            self.stats.crashes += 1
                            self.replace(index, f"crashed (exit code {worker.process.exitcode})", retry=True)
                busy = [w for w in self.workers if w.tasks is not None or not w.ready]
                deadline = min(map(self.deadline, busy)) - time.perf_counter() if busy else None
                ready = wait(
                    [self.wake_read] + [w.conn for w in busy] + [w.process.sentinel for w in busy],
                    timeout=None if deadline is None else max(deadline, 0.0) + 1e-3,
                )
                if self.wake_read in ready:
                    os.read(self.wake_read, 4096)
                if busy:
                    self.collect()
        finally:  # the read end only: stop() may still write its wake-up byte (it closes the write end)
            os.close(self.wake_read)

    def collect(self) -> None:
        now = time.perf_counter()
        for index, worker in enumerate(list(self.workers)):
            if worker.ready and worker.tasks is None:
                continue
            if worker.conn.poll():
                try:
                    scored, failures = worker.conn.recv()
                except (EOFError, OSError):
                    self.stats.crashes += 1
                    self.replace(index, f"crashed (exit code {worker.process.exitcode})", retry=True)
                    continue
                if not worker.ready:  # its first message: loaded, or why it could not
                    if scored == FAILED:
                        self.give_up(f"the reward function failed to load: {failures}")
                    worker.ready, worker.started = scored == READY, now
                    continue
                worker.tasks = None
                for key, reward in scored:
                    self.finish(key, reward, [])
                self.record_failures(failures)
            elif not worker.process.is_alive():
                self.stats.crashes += 1
                self.replace(index, f"crashed (exit code {worker.process.exitcode})", retry=True)
            elif now > self.deadline(worker):
                if not worker.ready:
                    self.give_up(
                        f"the reward function did not finish loading within rewards.load_timeout_s="
                        f"{self.load_timeout_s:g} s"
                    )
                    continue
                self.stats.timeouts += 1
                self.replace(index, f"timed out after {self.timeout_s:g} s")
