"""Atomic writes of a run directory's files (a kill at any instant leaves the old file or the new, whole),
and their checksums."""

from __future__ import annotations

import hashlib
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


def sha256(path: str | Path) -> str:
    """The file's SHA-256, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, fsync, then rename: a kill leaves the old file or the
    new."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(text, encoding="utf-8")
    fsync(temporary)
    os.replace(temporary, path)
    fsync(path.parent)


def write_json_atomic(path: str | Path, data) -> None:
    """`data` as indented JSON, atomically (`write_text_atomic`)."""
    write_text_atomic(path, json.dumps(data, indent=2))


def write_jsonl_atomic(path: str | Path, rows: list[dict]) -> None:
    """One JSON object per line, atomically (`write_text_atomic`)."""
    write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))
