"""The names a config may choose among, kept here, at the bottom of the layers, so that `config/` can
validate a value without importing the layers that implement it (they import the config).

- `FIELDS`: what `data.columns` maps a data file's columns onto (`data/datasets.py` reads them).
- Rollout engines: `rollout.engine` is `auto` or a registered engine. The built-in ones are named here
  (their classes register under these names when `everyprompt.rollout` is imported, and a test checks the
  two agree); an engine a user registers with `rollout.register_engine` is added to `ENGINES` then.
- Built-in tasks: `data.task` names one of `TASKS` (`data/tasks.py` registers each under these names, and a
  test checks the two agree).
- The native engine's decoding: `rollout.cuda_graphs` is one of `GRAPH_MODES`, `rollout.compile` one of
  `COMPILE_MODES`; `decoding` turns them and the rollout device into how the engine decodes, the one
  place that decides it (the config's check, `make_engine`, the engine and `RolloutConfig.sleeps` ask it).
  `rollout.graph_buckets` defaults to `GRAPH_BUCKETS` and must pass `check_buckets`.
"""

from __future__ import annotations

from dataclasses import dataclass

FIELDS = ("prompt", "answer", "solution", "level", "messages")

TASKS = ("arithmetic", "questions")  # the built-in tasks (data/arithmetic.py, data/questions.py)
GYM = "reasoning-gym"  # data.task: reasoning-gym's procedural tasks (data/gym.py)

AUTO_ENGINE = "auto"  # not an engine: the choice of the fastest registered engine that runs the model
NATIVE_ENGINE = "native"
HF_ENGINE = "hf"
ENGINES: set[str] = {NATIVE_ENGINE, HF_ENGINE}  # every engine name registered or built in


def engine_choices() -> list[str]:
    """What `rollout.engine` accepts: `auto` and every engine."""
    return [AUTO_ENGINE, *sorted(ENGINES)]


# auto: graphs on a CUDA device unless compile is on; on: graphs, a CUDA device required; off: none;
# static: the graphs' step run without capture, on any device (the same numbers: for telling a graph's fault
# from the step's, and the reference the graphs are tested against on a machine without CUDA)
GRAPH_MODES = ("auto", "on", "off", "static")
# off: eager; on: torch.compile at the first call; auto: once eager decoding has cost about a compile
COMPILE_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class Decoding:
    """How the native engine runs its decode step (rollout/native/: the static step in static_step.py, its
    graphs in graphs.py, the plain step in plain_step.py, torch.compile in compiled.py). `static`: the
    static step (buffers allocated once), else the plain one; `graphs`: the static step captured as CUDA
    graphs and replayed; `compile`: the step's forward and sampler through torch.compile: `on` from the
    first call (the static step's compiled bodies are what its graphs capture), `auto` (the plain step only)
    once eager decoding has cost about a compile, `off` never; `overlap`: each step's forward is sent to the
    device before the host reads the step's tokens (the static step on a CUDA device, which runs apart from
    the host: rollout/native/decode_loop.py)."""

    static: bool
    graphs: bool
    compile: str
    overlap: bool = False

    @property
    def name(self) -> str:
        """ "graphs", "compiled graphs", "static", "compiled static", "compiled", "eager" or "eager, compile auto"."""
        compiled = "compiled " if self.compile == "on" else ""
        if self.static:
            return f"{compiled}{'graphs' if self.graphs else 'static'}"
        return {"on": "compiled", "off": "eager", "auto": "eager, compile auto"}[self.compile]


def decoding(compile: str, cuda_graphs: str, device_type: str) -> Decoding:
    """How the engine decodes on a device of `device_type` ("cuda", "cpu", ...) under `rollout.compile` and
    `rollout.cuda_graphs`; ValueError naming the key for a value not known or settings that cannot hold.

    The static step runs where graphs are asked for (`on`, `static`) or allowed on a CUDA device (`auto`),
    and is captured on a CUDA device unless `static` asks otherwise. `compile=on` compiles whichever step
    runs (the static one's compiled bodies captured: fused kernels inside the graph); `compile=auto` applies
    to the plain step alone (the static step is never compiled mid-run: its graphs would be captured again)."""
    if compile not in COMPILE_MODES:
        raise ValueError(f"rollout.compile must be one of {', '.join(COMPILE_MODES)}, got {compile!r}")
    if cuda_graphs not in GRAPH_MODES:
        raise ValueError(f"rollout.cuda_graphs must be one of {', '.join(GRAPH_MODES)}, got {cuda_graphs!r}")
    if cuda_graphs == "on" and device_type != "cuda":
        raise ValueError(
            f"rollout.cuda_graphs=on needs a CUDA device; rollout.device is {device_type} (set auto, cuda or "
            "cuda:N, or rollout.cuda_graphs=auto)"
        )
    static = cuda_graphs in ("on", "static") or (cuda_graphs == "auto" and device_type == "cuda")
    if not static:
        return Decoding(static=False, graphs=False, compile=compile)
    return Decoding(
        static=True,
        graphs=cuda_graphs != "static",
        compile="on" if compile == "on" else "off",
        overlap=device_type == "cuda",
    )


# nano-vllm's buckets: 1, 2, 4, 8, then every 16 up to 512 (a 64-row pool shrinking to nothing meets 8)
GRAPH_BUCKETS = (1, 2, 4, 8, *range(16, 513, 16))


def check_buckets(buckets) -> tuple[int, ...]:
    """`buckets` as a tuple; ValueError unless they are increasing positive integers."""
    values = tuple(buckets)
    if not values or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in values):
        raise ValueError("expected a list of positive integers")
    if any(later <= earlier for earlier, later in zip(values, values[1:])):
        raise ValueError("expected increasing batch sizes")
    return values
