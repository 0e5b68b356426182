"""The names a config may choose among, kept here, at the bottom of the layers, so that `config/` can
validate a value without importing the layers that implement it (they import the config).

- `FIELDS`: what `data.columns` maps a data file's columns onto (`data/datasets.py` reads them).
- Rollout engines: `rollout.engine` is `auto` or a registered engine. The built-in ones are named here
  (their classes register under these names when `everyprompt.rollout` is imported, and a test checks the
  two agree); an engine a user registers with `rollout.register_engine` is added to `ENGINES` then.
- Built-in tasks: `data.task` names one of `TASKS` (`data/tasks.py` registers each under these names, and a
  test checks the two agree).
- The native engine's CUDA graphs: `rollout.cuda_graphs` is one of `GRAPH_MODES`; `rollout.graph_buckets`
  defaults to `GRAPH_BUCKETS` and must pass `check_buckets` (rollout/native/graphs.py uses both).
"""

from __future__ import annotations

FIELDS = ("prompt", "answer", "solution", "level", "messages")

TASKS = ("arithmetic", "questions")  # the built-in tasks (data/arithmetic.py, data/questions.py)

AUTO_ENGINE = "auto"  # not an engine: the choice of the fastest registered engine that runs the model
NATIVE_ENGINE = "native"
HF_ENGINE = "hf"
ENGINES: set[str] = {NATIVE_ENGINE, HF_ENGINE}  # every engine name registered or built in


def engine_choices() -> list[str]:
    """What `rollout.engine` accepts: `auto` and every engine."""
    return [AUTO_ENGINE, *sorted(ENGINES)]


GRAPH_MODES = ("auto", "on", "off")
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
