"""Prompt files (JSONL / Parquet) and the resumable prompt cursor."""

from __future__ import annotations

import json
import random
from pathlib import Path


class DataError(ValueError):
    """A data file that cannot be used; the message names the file, the line and what was expected."""


def _check_row(row: object, where: str, required: tuple[str, ...]) -> dict:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [f for f in required if f not in row]
    if missing:
        raise DataError(f"{where}: missing field(s) {missing}; the row has {sorted(row)}")
    return row


def read_jsonl(path: str | Path, required: tuple[str, ...] = ()) -> list[dict]:
    """Rows of a JSONL file; a malformed line raises DataError naming the file and the line number."""
    path = Path(path)
    rows = []
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err.strerror or err})") from None
    for number, data in enumerate(raw.split(b"\n"), start=1):
        try:
            line = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"{path}:{number}: not UTF-8 text (byte {err.start + 1} of the line)") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as err:
            why = (
                f"{err.msg} at column {err.colno}"
                if isinstance(err, json.JSONDecodeError)
                else "nested too deep"
            )
            raise DataError(f"{path}:{number}: not valid JSON ({why})") from None
        rows.append(_check_row(row, f"{path}:{number}", required))
    return rows


def read_parquet(path: str | Path, required: tuple[str, ...] = ()) -> list[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path}: not a readable Parquet file ({err})") from None
    missing = [f for f in required if f not in table.column_names]
    if missing:
        raise DataError(f"{path}: missing column(s) {missing}; the file has {table.column_names}")
    return table.to_pylist()


def load_prompt_file(
    path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer"
) -> list[dict]:
    """Prompt rows from JSONL or Parquet, normalised to `prompt` (str), `answer` (str), `level` (int or None)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    required = (prompt_field, answer_field)
    if path.suffix == ".parquet":
        rows = read_parquet(path, required)
    elif path.suffix in (".jsonl", ".json"):
        rows = read_jsonl(path, required)
    else:
        raise DataError(f"{path}: unsupported data format {path.suffix!r}; expected .jsonl or .parquet")
    out = []
    for index, row in enumerate(rows):
        prompt = row[prompt_field]
        if not isinstance(prompt, str) or not prompt:
            raise DataError(f"{path}: row {index + 1}: field {prompt_field!r} must be a non-empty string")
        level = row.get("level")
        out.append({**row, "prompt": prompt, "answer": str(row[answer_field]), "level": level})
    if not out:
        raise DataError(f"{path}: no rows")
    return out


class PromptCursor:
    """Walks a list of prompts in a seeded order, epoch after epoch; its state is saved in checkpoints."""

    def __init__(self, size: int, seed: int):
        if size <= 0:
            raise DataError("the prompt set is empty")
        self.size, self.seed = size, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        order = list(range(self.size))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def take(self, count: int) -> list[int]:
        indices = []
        while len(indices) < count:
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation()
            indices.append(self._order[self.position])
            self.position += 1
        return indices

    def state_dict(self) -> dict:
        return {"size": self.size, "seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != self.size:
            raise DataError(
                f"checkpoint's prompt cursor covers {state['size']} prompts, the data has {self.size}"
            )
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order = self._permutation()
