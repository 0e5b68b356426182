"""Atomic writes of a run directory's files (a kill at any instant leaves the old file or the new, whole),
and their checksums."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
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


def check_new_dir(out: str | Path, error: type[Exception]) -> Path:
    """`out`, if it does not exist or is an empty directory; else `error` naming it."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise error(f"{out}: exists and is not an empty directory; choose another output directory")
    return out


def write_dir_atomic(out: str | Path, write: Callable[[Path], None], error: type[Exception]) -> Path:
    """A new directory `out` whose files `write(folder)` puts into `folder`: written in a temporary folder
    beside `out` and renamed, so that a failure or a kill leaves no half-written `out`. `out` must not exist
    or be empty (else `error`, naming it)."""
    out = check_new_dir(out, error)
    temporary = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True)
        write(temporary)
        if out.exists():
            out.rmdir()
        os.replace(temporary, out)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return out
