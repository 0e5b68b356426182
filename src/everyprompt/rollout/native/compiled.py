"""The native engine's compiled decode step: one `torch.compile` (inductor) graph for a decode forward and
one for sampling, so a step runs a few fused kernels and the matrix products instead of a few hundred
eager operators, each with its dispatch overhead.

Both graphs are compiled with the row count (the pool, which shrinks as sequences finish) and the cache
width as dynamic sizes, so one graph serves every call; everything else (weights, heads, vocabulary) is
static, which keeps the generated loops vectorised (all sizes dynamic runs slower than eager). The
compiled step attends over the call's whole cache width (masked), in a cache exactly that wide. The MoE
layer's expert capacity (its busiest expert's token count) is data-dependent; it stays inside the graph
as an unbacked size (`capture_scalar_outputs`). Inductor's compile cache on disk (TORCHINDUCTOR_CACHE_DIR,
by default under the system temp directory) makes a second process's compile a fraction of the first.

`rollout.compile`:
  off  eager operators (the reference the compiled step is tested against);
  on   compile at the first generate call;
  auto compile (from the next generate call) once the engine has spent `auto_after_s` seconds in eager
       decode steps: the rule of
       renting until the rent paid equals the price of buying, which never spends more than twice what
       the better choice in hindsight would have, whatever the run's length. The default threshold is
       the compile time over the fraction of a decode step the compiled graph saves, measured by
       bench/throughput (docs/rollout.md).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable

import torch

from everyprompt.choices import COMPILE_MODES
from everyprompt.errors import in_one_line

log = logging.getLogger(__name__)

# bench/throughput (results/throughput.json), 2 CPU cores, the demo model, 64 rows: compiling takes
# 45.6 s from a cold inductor cache (7.4 s warm) and the compiled step saves 2.36 of the eager 6.09 ms
# (39%); buying pays once eager decoding has cost 45.6 / 0.39 ~ 118 s (the cold figure: a run cannot
# tell beforehand whether its cache is warm)
AUTO_AFTER_S = 120.0


def _configure_inductor() -> None:
    """Compile in this process (no pool of compile workers left to outlive it), with scalar outputs
    traced into the graph (the expert capacity), and room for every engine's graphs."""
    import torch._dynamo.config
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1
    torch._dynamo.config.capture_scalar_outputs = True
    # dynamo counts the graphs of one function across every engine of the process (each engine's own:
    # its weights, record / greedy variants); 8 by default, which a process with several engines reaches
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)


class DecodeCompiler:
    """Chooses, per generate call, the eager or the compiled forward and sampler of one engine; records
    the eager time spent (for `auto`) and the compile's cost (`stats`)."""

    def __init__(self, mode: str = "off", auto_after_s: float | None = None, give_up: bool | None = None):
        """`give_up`: a graph that fails to compile is given up with a warning and its eager function runs
        from then on (by default under `auto` only: under `on` the error stops the run); the static step
        gives up under `on` too, as a capture that fails does (its compiled bodies are an optimisation of
        the same numbers)."""
        if mode not in COMPILE_MODES:
            raise ValueError(f"rollout.compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
        self.mode = mode
        self.auto_after_s = AUTO_AFTER_S if auto_after_s is None else auto_after_s
        self.give_up = mode == "auto" if give_up is None else give_up
        self.eager_s = 0.0  # time spent in eager decode steps so far
        self.compile_s = 0.0  # time the compiled graphs' first calls took (tracing, code generation, gcc)
        self._forward: Callable | None = None
        self._sample: Callable | None = None
        self._pending: set[str] = set()  # compiled graphs not called yet (their first call compiles)
        self._eager: dict[str, Callable] = {}  # what each compiled graph stands for
        self._marked: weakref.ref | None = None  # the first cache tensor of the caches last marked dynamic
        self.failure: str | None = None  # auto: why compiling failed (the engine then stays eager)
        self._resumed = False  # a resumed run whose engine had compiled: compile at the next call

    @property
    def bound(self) -> bool:
        return self._forward is not None

    @property
    def active(self) -> bool:
        """Whether the next generate call runs compiled."""
        if self.failure is not None:
            return False
        if self._forward is not None or self._resumed:
            return True
        if self.mode == "on" or (self.mode == "auto" and self.eager_s >= self.auto_after_s):
            return True
        return False

    def bind(self, forward: Callable, sample: Callable) -> None:
        """Compile `forward` and `sample` (lazily: their first calls trace and build the graphs)."""
        _configure_inductor()
        if self.mode == "auto":
            log.info(
                "rollout.compile=auto: compiling the decode step after %.0f s of eager decoding", self.eager_s
            )
        self._eager = {"forward": forward, "sample": sample}
        self._forward = torch.compile(forward, fullgraph=True)
        self._sample = torch.compile(sample, fullgraph=True)
        self._pending = {"forward", "sample"}

    def forward(self, layers, tokens, positions, caches, record: bool):
        """The engine's `decode`, compiled: rows (dim 0) and cache width (dim 2) dynamic. A call's caches
        are marked once (they change only when the pool shrinks), the per-step tensors every step."""
        for tensor in (tokens, positions):
            torch._dynamo.mark_dynamic(tensor, 0)
        if self._marked is None or self._marked() is not caches[0][0]:
            for entry in caches:
                for tensor in entry:
                    torch._dynamo.mark_dynamic(tensor, 0)
                    torch._dynamo.mark_dynamic(tensor, 2)
            self._marked = weakref.ref(caches[0][0])
        return self._timed("forward", self._forward, layers, tokens, positions, caches, record)

    def sample(self, logits, seeds, positions, temperature, top_p, greedy):
        """`sample_tokens`, compiled: rows dynamic."""
        for tensor in (logits, seeds, positions):
            torch._dynamo.mark_dynamic(tensor, 0)
        return self._timed("sample", self._sample, logits, seeds, positions, temperature, top_p, greedy)

    def _timed(self, name: str, fn: Callable, *args):
        """`fn(*args)`, its first call's time counted as compile time. Where the compiler gives up (`auto`,
        and the static step's `on`) a compiled graph that fails (an operator or a model inductor cannot
        handle) is given up with a warning and the engine decodes eager from then on (`compile_failed`);
        otherwise the error stops the run."""
        if self.failure is not None:
            return self._eager[name](*args)
        first = name in self._pending
        began = time.perf_counter() if first else 0.0
        try:
            out = fn(*args)
        except Exception as err:
            if not self.give_up:
                raise
            self.failure = in_one_line(err)
            log.warning(
                "rollout.compile=%s: compiling the decode step failed (%s); decoding eager from now on "
                "(rollout.compile=off skips the attempt)",
                self.mode,
                self.failure,
            )
            return self._eager[name](*args)
        if first:
            self.compile_s += time.perf_counter() - began
            self._pending.discard(name)
        return out

    def state_dict(self) -> dict:
        """What a resumed run needs to decode as this run would have gone on: the eager time counted and
        whether the decode step was compiled or given up. `auto`'s switch depends on the machine's speed,
        and the compiled step's log-probs differ from the eager step's in the last bits, which an RL run
        carries into its updates: a resumed run that started eager again would drift from the one it
        continues."""
        return {
            "mode": self.mode,
            "eager_s": self.eager_s,
            "compiled": self._forward is not None or self._resumed,
            "failure": self.failure,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state_dict()`'s record; a record of another `rollout.compile` mode (the setting
        changed for the resume) is left alone: the new setting decides."""
        if state.get("mode") != self.mode:
            log.info(
                "rollout.compile=%s on resume (the checkpoint's run had %s): its compile state not restored",
                self.mode,
                state.get("mode"),
            )
            return
        self.eager_s = float(state["eager_s"])
        self.failure = state["failure"]
        self._resumed = bool(state["compiled"]) and self.failure is None

    def add_eager(self, seconds: float) -> None:
        self.eager_s += seconds

    def stats(self) -> dict[str, float]:
        return {
            "compiled": float(self._forward is not None and self.failure is None),
            "compile_s": self.compile_s,
            "compile_failed": float(self.failure is not None),
        }
