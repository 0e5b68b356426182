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

from enum import Enum

FIELDS = ("prompt", "answer", "solution", "level", "messages")

TASKS = ("arithmetic", "questions")  # the built-in tasks (data/arithmetic.py, data/questions.py)

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


class Decoding(str, Enum):
    """How the native engine runs its decode step (rollout/native/: the static step in static_step.py, its
    graphs in graphs.py, the plain step in plain_step.py, the compiled one in compiled.py)."""

    GRAPHS = "graphs"  # the static step, captured as CUDA graphs and replayed
    STATIC = "static"  # the static step, run eagerly
    COMPILED = "compiled"  # the plain step through torch.compile from the first call
    EAGER = "eager"  # the plain step, eager (`compile=auto` may compile it once eager decoding cost enough)

    @property
    def static(self) -> bool:
        return self in (Decoding.GRAPHS, Decoding.STATIC)


def decoding(compile: str, cuda_graphs: str, device_type: str) -> Decoding:
    """How the engine decodes on a device of `device_type` ("cuda", "cpu", ...) under `rollout.compile` and
    `rollout.cuda_graphs`; ValueError naming the keys for a value not known or settings that conflict."""
    if compile not in COMPILE_MODES:
        raise ValueError(f"rollout.compile must be one of {', '.join(COMPILE_MODES)}, got {compile!r}")
    if cuda_graphs not in GRAPH_MODES:
        raise ValueError(f"rollout.cuda_graphs must be one of {', '.join(GRAPH_MODES)}, got {cuda_graphs!r}")
    if cuda_graphs in ("on", "static") and compile == "on":
        raise ValueError(
            f"rollout.cuda_graphs={cuda_graphs} and rollout.compile=on: the decode step is either the static "
            "one (captured) or compiled; set one of them off"
        )
    if cuda_graphs == "on" and device_type != "cuda":
        raise ValueError(
            f"rollout.cuda_graphs=on needs a CUDA device; rollout.device is {device_type} (set auto, cuda or "
            "cuda:N, or rollout.cuda_graphs=auto)"
        )
    if cuda_graphs == "static":
        return Decoding.STATIC
    if cuda_graphs != "off" and device_type == "cuda" and compile != "on":
        return Decoding.GRAPHS
    return Decoding.COMPILED if compile == "on" else Decoding.EAGER


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
