"""The pass-rate store: what the run has learned about each prompt's difficulty.

Per prompt (keyed by a hash of its text, so that a store written by `everyprompt filter` on one file
serves a training run on another that shares prompts): attempts, successes, an exponential moving
average of the pass rate, the mean completion length, the current streaks of all-correct / all-wrong
groups, and a status (active, retired, deferred). The offline filter (ZVE stage 0), online retirement
(stage 4), the curriculum's difficulty buckets and the length-aware scheduler all read it.

Storage is SQLite: every `record` call commits one transaction, so a killed run loses at most the
step in flight, and `snapshot` copies a consistent image into a checkpoint directory.
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ACTIVE, RETIRED, DEFERRED = "active", "retired", "deferred"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS prompts (
    key TEXT PRIMARY KEY,
    attempts INTEGER NOT NULL,
    successes INTEGER NOT NULL,
    ema REAL NOT NULL,
    mean_length REAL NOT NULL,
    correct_streak INTEGER NOT NULL,
    wrong_streak INTEGER NOT NULL,
    status TEXT NOT NULL,
    until_step INTEGER NOT NULL,
    updated_step INTEGER NOT NULL
)
"""
_COLUMNS = "key, attempts, successes, ema, mean_length, correct_streak, wrong_streak, status, until_step, updated_step"


def prompt_key(prompt: str) -> str:
    """Stable 16-hex-digit key of a prompt's text."""
    return hashlib.sha1(prompt.encode("utf-8")).hexdigest()[:16]


@dataclass
class PromptStats:
    attempts: int = 0
    successes: int = 0
    ema: float = 0.0  # EMA of the per-visit pass rate (the first visit sets it)
    mean_length: float = 0.0  # mean completion length over all attempts (tokens)
    correct_streak: int = 0  # consecutive visits whose group was all-correct
    wrong_streak: int = 0  # consecutive visits whose group was all-wrong
    status: str = ACTIVE
    until_step: int = 0  # deferred prompts return at this step
    updated_step: int = -1

    @property
    def pass_rate(self) -> float:
        """The empirical pass rate over all attempts (0 before any)."""
        return self.successes / self.attempts if self.attempts else 0.0


@dataclass
class StoreCounts:
    retired: int = 0
    deferred: int = 0
    returned: int = 0
    changes: dict[str, str] = field(default_factory=dict)


class PassRateStore:
    """Per-prompt pass-rate statistics, in memory, mirrored to an SQLite file when given a path."""

    def __init__(self, path: str | Path | None = None, ema_decay: float = 0.5):
        if not 0 <= ema_decay < 1:
            raise ValueError(f"ema_decay must be in [0, 1), got {ema_decay}")
        self.ema_decay = ema_decay
        self.path = Path(path) if path is not None else None
        self._stats: dict[str, PromptStats] = {}
        self._db: sqlite3.Connection | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                # an asynchronous run records from its rollout thread (never two threads at once)
                self._db = sqlite3.connect(self.path, check_same_thread=False)
                self._db.execute(_SCHEMA)
                rows = self._db.execute(f"SELECT {_COLUMNS} FROM prompts").fetchall()
            except sqlite3.DatabaseError as err:
                raise ValueError(f"{self.path}: not a pass-rate store ({err})") from None
            for key, *values in rows:
                self._stats[key] = PromptStats(*values)

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return len(self._stats)

    def __contains__(self, prompt: str) -> bool:
        return prompt_key(prompt) in self._stats

    def get(self, prompt: str) -> PromptStats | None:
        return self._stats.get(prompt_key(prompt))

    def pass_rate(self, prompt: str, default: float | None = None) -> float | None:
        """The prompt's EMA pass rate, or `default` if it was never attempted."""
        stats = self.get(prompt)
        return stats.ema if stats is not None and stats.attempts else default

    def is_available(self, prompt: str, step: int) -> bool:
        """False for retired prompts and for deferred ones before their return step."""
        stats = self.get(prompt)
        if stats is None or stats.status == ACTIVE:
            return True
        return stats.status == DEFERRED and step >= stats.until_step

    def counts(self) -> dict[str, int]:
        out = {ACTIVE: 0, RETIRED: 0, DEFERRED: 0}
        for stats in self._stats.values():
            out[stats.status] += 1
        return out

    # ------------------------------------------------------------------ writing
    def record(
        self,
        visits: Iterable[tuple[str, int, int, float]],
        step: int,
        retire_after: int = 0,
        defer_after: int = 0,
        defer_steps: int = 0,
    ) -> StoreCounts:
        """Record one step's groups: (prompt, attempts, successes, mean completion length) per group.

        A prompt whose group came back all-correct `retire_after` visits in a row is retired; one all-wrong
        `defer_after` visits in a row is deferred for `defer_steps` steps (0 disables either rule). A
        deferred prompt that returns starts its streaks afresh.
        """
        counts = StoreCounts()
        touched = []
        for prompt, attempts, successes, mean_length in visits:
            if attempts <= 0 or not 0 <= successes <= attempts:
                raise ValueError(f"bad visit for {prompt!r}: {successes} successes of {attempts} attempts")
            key = prompt_key(prompt)
            stats = self._stats.setdefault(key, PromptStats())
            if stats.status == DEFERRED and step >= stats.until_step:
                stats.status, stats.wrong_streak = ACTIVE, 0
                counts.returned += 1
            rate = successes / attempts
            first = stats.attempts == 0
            stats.ema = rate if first else self.ema_decay * stats.ema + (1 - self.ema_decay) * rate
            total = stats.attempts + attempts
            stats.mean_length = (stats.mean_length * stats.attempts + mean_length * attempts) / total
            stats.attempts, stats.successes = total, stats.successes + successes
            stats.correct_streak = stats.correct_streak + 1 if successes == attempts else 0
            stats.wrong_streak = stats.wrong_streak + 1 if successes == 0 else 0
            stats.updated_step = step
            if stats.status == ACTIVE:
                if retire_after and stats.correct_streak >= retire_after:
                    stats.status = RETIRED
                    counts.retired += 1
                    counts.changes[prompt] = RETIRED
                elif defer_after and stats.wrong_streak >= defer_after:
                    stats.status, stats.until_step = DEFERRED, step + 1 + defer_steps
                    counts.deferred += 1
                    counts.changes[prompt] = DEFERRED
            touched.append(key)
        self._write(touched)
        return counts

    def _write(self, keys: list[str]) -> None:
        if self._db is None or not keys:
            return
        rows = [(key, *_values(self._stats[key])) for key in dict.fromkeys(keys)]
        with self._db:  # one transaction: all of this step's rows or none
            self._db.executemany(
                f"INSERT OR REPLACE INTO prompts ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows
            )

    def state_dict(self) -> dict:
        return {key: _values(stats) for key, stats in self._stats.items()}

    def load_state_dict(self, state: dict) -> None:
        """Replace the contents (in memory and on disk) with a checkpoint's."""
        self._stats = {key: PromptStats(*values) for key, values in state.items()}
        if self._db is not None:
            with self._db:
                self._db.execute("DELETE FROM prompts")
            self._write(list(self._stats))

    def snapshot(self, path: str | Path) -> None:
        """A consistent copy of the store as an SQLite file at `path` (for checkpoints and reports)."""
        target = sqlite3.connect(path)
        try:
            target.execute(_SCHEMA)
            with target:
                target.execute("DELETE FROM prompts")
                target.executemany(
                    f"INSERT INTO prompts ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [(key, *values) for key, values in self.state_dict().items()],
                )
        finally:
            target.close()

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


def _values(stats: PromptStats) -> tuple:
    return (
        stats.attempts,
        stats.successes,
        stats.ema,
        stats.mean_length,
        stats.correct_streak,
        stats.wrong_streak,
        stats.status,
        stats.until_step,
        stats.updated_step,
    )
