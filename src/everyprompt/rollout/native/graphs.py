"""CUDA graphs of the native engine's static decode step (static_step.py), one per phase and batch bucket.

On a GPU a small model's decode step is a few hundred kernel launches around a few milliseconds of
arithmetic; replaying a captured graph launches them all at once. The rules are the fast engines' (nano-vllm,
vLLM): a step of n rows runs as its bucket, the smallest of `buckets` >= n, its padding rows inert (static_step.py
says why); above the largest bucket it runs eagerly at its own size. A bucket's graph is captured the first
time the bucket runs (after a warm-up run on a side stream, which sets up the libraries' workspaces and
computes the very values the step writes), into one memory pool that every graph of the engine shares: a
step writes everything it keeps into the engine's step buffers, so what a graph allocates is scratch,
reused by the next graph. Graphs stay valid while the buffers, the cache storage and the weights keep
their addresses (the engine's `load_weights` copies in place); the engine drops them (`reset`) when any of
these is reallocated.

Whether an engine captures is decided with how it decodes (choices.decoding, from `rollout.cuda_graphs`,
`rollout.compile` and the device): `Decoding.graphs`. With `compile=on` the bodies captured are
torch.compile's (compiled.py): Inductor's fused kernels inside the graph.
A graph is trusted only once its first replay has written what the eager warm-up wrote on the same inputs,
judged at the precision the step computes in (trust.py: tokens equal, values within a few epsilons of the
step's dtype at each row's scale, within which a greedy token can change only on a near-tie). A capture that fails (an
operator that cannot be captured, a host read on the way, a replay that disagrees) is reported once, with
why, and the engine decodes with the same static step run eagerly from then on: a run never dies of it,
and every later call's figures say so (`graph_failed`, `graph_eager_steps`).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Hashable

import torch

from everyprompt.choices import GRAPH_BUCKETS, check_buckets
from everyprompt.errors import in_one_line
from everyprompt.rollout.native.trust import Output, judge

log = logging.getLogger(__name__)

# the most variants (keys) a phase is captured for: a server whose clients ask for many sampling settings
# gets graphs for the first few, and runs the others' steps eagerly (the same step, the same numbers)
MAX_KEYS = 8


class StepGraphs:
    """The graphs of one engine: `run(phase, key, rows, body)` runs `body(bucket)` for a step of `rows`
    rows, replayed from its graph when it has one. `capture=False` runs every body eagerly (the CPU's
    static step, and the reference the graphs are tested against)."""

    def __init__(self, buckets=GRAPH_BUCKETS, capture: bool = False, device: torch.device | None = None):
        self.buckets, self.capture, self.device = check_buckets(buckets), capture, device
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.failure: str | None = None  # why a capture failed (the engine then runs its bodies eagerly)
        self.capture_s = 0.0  # time spent capturing (warm-ups included), this engine's life
        self.pool_bytes = 0  # device memory the captures reserved
        self.replay_eps = 0.0  # the largest difference a trusted graph's first replay showed (trust.py)
        self._call = dict.fromkeys(("replays", "eager", "captures", "capture_s"), 0)

    def padded(self, rows: int) -> int:
        """The rows a step of `rows` runs: its bucket, or `rows` itself above the largest bucket."""
        at = bisect.bisect_left(self.buckets, rows)
        return self.buckets[at] if at < len(self.buckets) else rows

    def run(
        self,
        phase: str,
        key: Hashable,
        rows: int,
        body: Callable[[int], None],
        outputs: Callable[[int], list[Output]],
    ) -> None:
        """One step of `rows` rows: `body(padded rows)` through the graph of its phase, key (what the body
        bakes in: the call's sampling settings, what it records) and bucket, captured now if it has none;
        or eagerly (no capture, a failed one, above the largest bucket, or a phase's `MAX_KEYS` keys
        taken). `outputs(size)`: the buffers the body writes, and how a new graph's first replay of each is
        judged against the eager step's (trust.py)."""
        size = self.padded(rows)
        graph = self._graphs.get((phase, key, size))
        if graph is None and (
            not self.capture
            or self.failure is not None
            or size not in self.buckets
            or len({k for p, k, _ in self._graphs if p == phase} - {key}) >= MAX_KEYS
        ):
            self._call["eager"] += 1
            body(size)
            return
        if graph is None:  # captured, and replayed once: that replay is this step
            graph = self._capture(phase, size, body, outputs)
            if graph is None:
                self._call["eager"] += 1
                body(size)
                return
            self._graphs[(phase, key, size)] = graph
        else:
            graph.replay()
        self._call["replays"] += 1

    def _capture(self, phase: str, size: int, body, outputs):
        """`body(size)` captured as a CUDA graph and replayed once, trusted only if that replay wrote what
        the eager warm-up did on the same inputs, at the step's precision (trust.py); None, reported once,
        if capture fails or the replay disagrees."""
        began = time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.device)
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                body(size)  # warm-up: library workspaces, lazily made tables; writes what the step writes
            torch.cuda.current_stream(self.device).wait_stream(stream)
            eager = [output.tensor.clone() for output in outputs(size)]
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # thread-local: the learner may be using the GPU from another thread meanwhile (asynchrony)
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                body(size)
            graph.replay()
            verdicts = [judge(i, out.tensor, b, out) for i, (out, b) in enumerate(zip(outputs(size), eager))]
            differ = [why for why, _ in verdicts if why is not None]
            if differ:
                raise RuntimeError(
                    "its first replay wrote other values than the eager step on the same inputs: "
                    + "; ".join(differ)
                )
        except Exception as err:  # noqa: BLE001 (any capture failure: the step runs eagerly instead)
            self.failure = in_one_line(err)
            log.warning(
                "rollout.cuda_graphs: capturing the %s step of %d rows failed (%s); decoding without CUDA "
                "graphs from now on (rollout.cuda_graphs=off skips the attempt)",
                phase,
                size,
                self.failure,
            )
            self._graphs.clear()
            return None
        self.replay_eps = max([self.replay_eps, *(eps for _, eps in verdicts)])
        seconds = time.perf_counter() - began
        self.capture_s += seconds
        self._call["capture_s"] += seconds
        self.pool_bytes += max(torch.cuda.memory_reserved(self.device) - reserved, 0)
        self._call["captures"] += 1
        return graph

    def reset(self) -> None:
        """Drop every graph (the buffers, cache or weights they read were reallocated)."""
        self._graphs.clear()
        self._pool = None

    @property
    def graphs(self) -> int:
        return len(self._graphs)

    def start_call(self) -> None:
        self._call = dict.fromkeys(self._call, 0)

    def stats(self) -> dict[str, float]:
        """A generate call's figures: replayed and eager static steps, captures made and their seconds,
        and the engine's so far (graphs held, capture seconds, MiB reserved, the largest difference a trusted
        graph's first replay showed, in epsilons of its precision), whether a capture failed."""
        return {
            "graph_replays": float(self._call["replays"]),
            "graph_eager_steps": float(self._call["eager"]),
            "graph_captures": float(self._call["captures"]),
            "graph_capture_s": float(self._call["capture_s"]),
            "graphs": float(self.graphs),
            "graph_capture_total_s": self.capture_s,
            "graph_pool_mib": self.pool_bytes / 2**20,
            "graph_replay_eps": self.replay_eps,
            "graph_failed": float(self.failure is not None),
        }
