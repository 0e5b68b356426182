"""The names a config may choose among, kept here, at the bottom of the layers, so that `config/` can
validate a value without importing the layers that implement it (they import the config).

- `FIELDS`: what `data.columns` maps a data file's columns onto (`data/datasets.py` reads them).
- Rollout engines: `rollout.engine` is `auto` or a registered engine. The built-in ones are named here
  (their classes register under these names when `everyprompt.rollout` is imported, and a test checks the
  two agree); an engine a user registers with `rollout.register_engine` is added to `ENGINES` then.
- Built-in tasks: `data.task` names one of `TASKS` (`data/tasks.py` registers each under these names, and a
  test checks the two agree).
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
