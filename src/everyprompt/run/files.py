"""Atomic writes of a run directory's files: a kill at any instant leaves the old file or the new, whole."""

from __future__ import annotations

import json
import os
from pathlib import Path


def fsync(path: str | Path) -> None:
    """Flush a file's (or a directory's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: str | Path, data) -> None:
    """Write JSON to a temporary file beside `path`, fsync, then rename: a kill leaves the old file or the new."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(json.dumps(data, indent=2))
    fsync(temporary)
    os.replace(temporary, path)
    fsync(path.parent)


def write_jsonl_atomic(path: str | Path, rows: list[dict]) -> None:
    """One JSON object per line, written like `write_json_atomic` (whole or not at all)."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    fsync(temporary)
    os.replace(temporary, path)
    fsync(path.parent)
