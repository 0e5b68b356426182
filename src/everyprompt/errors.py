"""The two kinds of failure the `everyprompt` command tells apart, at the bottom of the layers so that any
module can raise them.

- `InputError`: the user's input is wrong (a config key, a data file, a checkpoint, a model, a reward
  function). Its message names the file and line, the key or the value, and what was expected; the CLI
  prints it and exits 2.
- `RunError`: the run itself went wrong (non-finite numbers, a lost cluster member); the CLI exits 1 and
  says where the last good state is.

Each package defines its own subclasses (`ConfigError`, `DataError`, `CheckpointError`, ...), so callers
can catch one concern's errors; the CLI catches these two bases.
"""

from __future__ import annotations


def in_one_line(err: BaseException) -> str:
    """An error's type and the first line of its message, for a warning that says why a fast path was given
    up (a failed compile or graph capture)."""
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first}"


class InputError(ValueError):
    """Bad input a user can fix; the message says what was wrong and what was expected (exit 2)."""


class RunError(RuntimeError):
    """The run went wrong through no fault of its input (exit 1)."""


class ClusterError(RunError):
    """The Ray backend cannot go on: actors that cannot be placed, a learner rank lost."""
