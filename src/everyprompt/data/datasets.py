"""Prompt files (JSONL, JSON, Parquet, Arrow: the formats `datasets` reads and writes locally), their
column mapping onto everyprompt's fields, and the resumable prompt cursor."""

from __future__ import annotations

import json
import random
from pathlib import Path

from everyprompt.choices import FIELDS  # what `data.columns` may map onto
from everyprompt.errors import InputError
from everyprompt.hub import resolve_data


class DataError(InputError):
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
    return [row for _, row in _jsonl_rows(Path(path), required)]


def _jsonl_rows(path: Path, required: tuple[str, ...] = ()) -> list[tuple[str, dict]]:
    """(`file:line`, row) for each non-blank line of a JSONL file."""
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
        rows.append((f"{path}:{number}", _check_row(row, f"{path}:{number}", required)))
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


def _json_rows(path: Path) -> list[tuple[str, dict]]:
    """A .json file: a JSON array of objects (as `datasets` writes with `lines=False`), else JSON Lines."""
    with path.open("rb") as handle:
        if not handle.read(4096).lstrip().startswith(b"["):
            return _jsonl_rows(path)
    try:
        rows = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text (byte {err.start + 1})") from None
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(rows, list):
        raise DataError(
            f"{path}: expected a JSON array of objects or JSON Lines, got a {type(rows).__name__}"
        )
    return [
        (f"{path}: item {number}", _check_row(row, f"{path}: item {number}", ()))
        for number, row in enumerate(rows, start=1)
    ]


def _parquet_rows(path: Path) -> list[tuple[str, dict]]:
    return [(f"{path}: row {n}", row) for n, row in enumerate(read_parquet(path), start=1)]


def _arrow_rows(path: Path) -> list[tuple[str, dict]]:
    """An Arrow file (IPC stream, as `datasets` caches and `save_to_disk` writes, or IPC file), or a
    `save_to_disk` directory of them."""
    import pyarrow as pa

    files = sorted(path.glob("*.arrow")) if path.is_dir() else [path]
    if not files:
        raise DataError(f"{path}: a directory with no .arrow files (expected a `save_to_disk` split)")
    tables = []
    for file in files:
        try:
            with pa.memory_map(str(file)) as source:
                try:
                    tables.append(pa.ipc.open_stream(source).read_all())
                except pa.ArrowInvalid:
                    tables.append(pa.ipc.open_file(source).read_all())
        except (pa.ArrowException, OSError) as err:
            raise DataError(f"{file}: not a readable Arrow file ({err})") from None
    rows = [row for table in tables for row in table.to_pylist()]
    return [(f"{path}: row {n}", row) for n, row in enumerate(rows, start=1)]


READERS = {".jsonl": _jsonl_rows, ".json": _json_rows, ".parquet": _parquet_rows, ".arrow": _arrow_rows}


def read_rows(path: str | Path) -> list[tuple[str, dict]]:
    """(where, row) for each row of a data file by its suffix (.jsonl, .json, .parquet, .arrow) or of a
    `save_to_disk` directory; `where` names the file and the line (JSONL) or row."""
    path = Path(path)
    if path.is_dir():
        return _arrow_rows(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    reader = READERS.get(path.suffix)
    if reader is None:
        raise DataError(
            f"{path}: unsupported data format {path.suffix!r}; expected {', '.join(READERS)} "
            "or a `datasets` save_to_disk directory"
        )
    return reader(path)


def load_prompt_file(
    path: str | Path,
    columns: dict[str, str] | None = None,
    require: tuple[str, ...] = ("answer",),
    what: str = "data file",
) -> list[dict]:
    """Prompt rows of a data file, with `prompt` (str), `answer` (str), `level` and, where present,
    `solution` and `messages` set from the file's columns by `columns` (field -> the file's column
    name; e.g. {"prompt": "question"}). A prompt column that holds a list of messages (as verl's and
    skyrl-gym's datasets do) is the row's `messages`, and its last user message the `prompt`. Every row needs a prompt (or `messages`) and the fields of
    `require`; a missing column is a DataError naming the file and the columns it has. `path` may be a
    file of a Hub dataset repo (`hf://datasets/ORG/NAME[@REVISION]/PATH`, `what`: the key that named it)."""
    path = resolve_data(path, what)
    columns = dict(columns or {})
    unknown = sorted(set(columns) - set(FIELDS))
    if unknown:
        raise DataError(f"data.columns maps {unknown}; it maps onto {', '.join(FIELDS)}")
    rows = read_rows(path)
    if not rows:
        raise DataError(f"{path}: no rows")
    have = sorted({key for _, row in rows for key in row})

    def source(field: str) -> str:
        return columns.get(field, field)

    def missing(field: str) -> DataError:
        mapped = f" (data.columns.{field})" if field in columns else ""
        return DataError(
            f"{path}: no column {source(field)!r} for `{field}`{mapped}; the file has columns {have}"
        )

    if source("prompt") not in have and source("messages") not in have:
        raise missing("prompt")
    for field in require:
        if source(field) not in have:
            raise missing(field)
    return [_normalise(row, where, source, require) for where, row in rows]


def _normalise(row: dict, where: str, source, require) -> dict:
    needed = [source(f) for f in require if source(f) not in row]
    if source("prompt") not in row and source("messages") not in row:
        needed.insert(0, source("prompt"))
    if needed:
        raise DataError(f"{where}: missing field(s) {needed}; the row has {sorted(row)}")
    out = dict(row)
    for field in ("answer", "solution", "level", "messages"):
        if source(field) in row:
            out[field] = row[source(field)]
    if isinstance(row.get(source("prompt")), list) and out.get("messages") is None:
        out["messages"] = row[source("prompt")]  # a conversation (verl's and skyrl-gym's layout)
    messages = out.get("messages")
    if messages is not None:
        _check_messages(messages, where)
    prompt = row.get(source("prompt"))
    if (prompt is None or isinstance(prompt, list)) and messages is not None:
        prompt = next((m["content"] for m in reversed(messages) if m["role"] == "user"), None)
    if not isinstance(prompt, str) or not prompt:
        raise DataError(f"{where}: field {source('prompt')!r} must be a non-empty string")
    out["prompt"] = prompt
    if "answer" in out:
        out["answer"] = str(out["answer"])
    out["level"] = out.get("level")
    return out


def _check_messages(messages: object, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: `messages` must be a non-empty list of {{role, content}} objects")
    for number, message in enumerate(messages, start=1):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
            raise DataError(f"{where}: message {number} has no string `role`")
        if not isinstance(message.get("content"), str):
            raise DataError(f"{where}: message {number} has no string `content`")


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
