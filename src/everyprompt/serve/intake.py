"""The scored groups an outside driver posts to a driven run (`POST /v1/rollouts`, serve/driven.py): their
wire format, the checks a group must pass to be trainable, and the queue the run's steps take them from.

A group the endpoint acknowledges (HTTP 200) is never lost: before the answer, every group of the request
is appended to the run's journal (`rollouts.jsonl` in the run directory, one line a request, flushed and
fsynced), and the run's checkpoints record how many groups its steps had taken. A run resumed after a kill
reads the journal back and queues every group after that count, in the order they were acknowledged, so
each acknowledged group is trained on exactly once; the driver re-posts nothing. A line cut short by the
kill was never acknowledged, and is dropped. The journal holds what the driver posted, as it came.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from everyprompt.errors import InputError, RunError

POLL_S = 1.0  # how often a step waiting for groups looks whether the server still runs


class Sample(BaseModel):
    """One rollout of a group, as the driver saw it: `prompt_token_ids` and `token_ids` as the endpoint
    returned them (`return_token_ids`); a multi-turn rollout's `token_ids` hold every token after the
    prompt and `mask` says which are the model's (True) and which its environment's (False)."""

    prompt_token_ids: list[int] = Field(min_length=1)
    token_ids: list[int] = Field(min_length=1)
    logprobs: list[float]  # the model's log-prob of each token (any value at environment tokens)
    mask: list[bool] | None = None
    reward: float | None  # None: could not be scored (left out of the group's statistics)
    finish_reason: Literal["stop", "length", "eos"] = "stop"


class Group(BaseModel):
    samples: list[Sample] = Field(min_length=1)


class Rollouts(BaseModel):
    groups: list[Group] = Field(min_length=1)


class Intake:
    """The groups acknowledged and not yet taken by a step, in order; `journal` (a path): where they are
    kept durably (read back when it exists: a resumed run). `check` refuses a group the learner could not
    train on."""

    def __init__(self, group_size: int, vocab_size: int, max_tokens: int, journal: Path | None = None):
        self.group_size, self.vocab_size, self.max_tokens = group_size, vocab_size, max_tokens
        self.pending: list[Group] = []
        self.received = 0  # groups acknowledged over the run
        self.taken = 0  # groups taken by its steps
        self._changed = threading.Condition()
        self._journal = None
        if journal is not None:
            self.pending = read_journal(journal)
            self.received = len(self.pending)
            self._journal = open(journal, "a", encoding="utf-8")  # noqa: SIM115 (closed by `close`)

    @property
    def queued(self) -> int:
        with self._changed:
            return len(self.pending)

    def check(self, group: Group, where: str) -> str | None:
        """What is wrong with `group` (the message of a 400), or None."""
        if len(group.samples) != self.group_size:
            return f"{where}: {len(group.samples)} samples; rl.group_size is {self.group_size}"
        for number, sample in enumerate(group.samples):
            at = f"{where}.samples[{number}]"
            if len(sample.logprobs) != len(sample.token_ids):
                return f"{at}: {len(sample.logprobs)} logprobs for {len(sample.token_ids)} token_ids"
            if sample.mask is not None and len(sample.mask) != len(sample.token_ids):
                return f"{at}: {len(sample.mask)} mask values for {len(sample.token_ids)} token_ids"
            if sample.mask is not None and not any(sample.mask):
                return f"{at}: no token of the model's own (mask is all false)"
            if len(sample.token_ids) > self.max_tokens:
                return f"{at}: {len(sample.token_ids)} token_ids; at most {self.max_tokens}"
            ids = [*sample.prompt_token_ids, *sample.token_ids]
            if any(not 0 <= t < self.vocab_size for t in ids):
                return f"{at}: token ids must be in [0, {self.vocab_size})"
            if sample.reward is not None and not math.isfinite(sample.reward):
                return f"{at}: reward must be a finite number or null"
        return None

    def add(self, rollouts: Rollouts) -> str | None:
        """Queue every group, or none of them (the message of the first problem); written to the journal
        first, so that a group acknowledged is one kept."""
        for number, group in enumerate(rollouts.groups):
            problem = self.check(group, f"groups[{number}]")
            if problem:
                return problem
        with self._changed:
            if self._journal is not None:
                self._append(rollouts)
            self.pending.extend(rollouts.groups)
            self.received += len(rollouts.groups)
            self._changed.notify_all()
        return None

    def _append(self, rollouts: Rollouts) -> None:
        """One line for the request, on disk before the answer; a failed write leaves no part of it."""
        start = self._journal.tell()
        try:
            self._journal.write(rollouts.model_dump_json() + "\n")
            self._journal.flush()
            os.fsync(self._journal.fileno())
        except BaseException:
            self._journal.truncate(start)
            self._journal.seek(start)
            raise

    def take(self, count: int, wait_s: float, alive) -> list[Group]:
        """The next `count` groups, waiting up to `wait_s` seconds for them; RunError past that."""
        deadline = time.monotonic() + wait_s
        with self._changed:
            while len(self.pending) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RunError(
                        f"external.wait_s={wait_s:g} s passed with {len(self.pending)} of the step's {count} "
                        "groups posted to /v1/rollouts (is the driver running? docs/serving.md)"
                    )
                if not alive():
                    raise RunError("the run's server stopped while waiting for groups")
                self._changed.wait(min(left, POLL_S))
            taken, self.pending = self.pending[:count], self.pending[count:]
            self.taken += count
        return taken

    def resume(self, taken: int) -> None:
        """A resumed run's steps had taken the journal's first `taken` groups: the rest are queued."""
        with self._changed:
            if taken > self.received:
                raise RunError(
                    f"the checkpoint's steps took {taken} groups; the run's journal holds {self.received}"
                )
            self.pending = self.pending[taken - self.taken :]
            self.taken = taken

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()


def read_journal(path: Path) -> list[Group]:
    """Every group of a journal, in order. Only whole lines were acknowledged: a last line without its
    newline (the run killed while writing it, before its answer) is cut off the file; a bad whole line is
    an error naming the file and line."""
    if not path.exists():
        return []
    data = path.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) < len(data):
        with open(path, "r+b") as journal:
            journal.truncate(len(whole))
    groups: list[Group] = []
    for number, line in enumerate(whole.decode("utf-8").splitlines(), start=1):
        try:
            groups.extend(Rollouts.model_validate(json.loads(line)).groups)
        except ValueError as err:
            raise InputError(f"{path}:{number}: not a line of acknowledged groups ({err})") from None
    return groups
