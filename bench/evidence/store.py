"""The evidence file (bench/results/evidence.json): read, written under a lock with every contrast
recomputed, and merged with another copy's runs (`python -m bench.evidence --merge FILE`)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import sys
from pathlib import Path

from bench.common import repo_path, write_results
from bench.evidence.plan import COMPARISONS
from bench.evidence.verdicts import contrasts


def load(path: Path) -> dict:
    if path.is_file():
        return json.loads(path.read_text())
    return {"benchmark": "evidence", "preregistration": "docs/evidence.md", "comparisons": {}}


def save(path: Path, payload: dict, smoke: bool, name: str, setup_name: str) -> dict:
    """Write `payload`'s records of comparison `name` on `setup_name` into the file as it is now, under a
    lock, with every contrast recomputed (a smoke run's file says it is one), so that calls running other
    comparisons at the same time keep each other's records; the payload written."""
    with locked(path):
        mine = payload["comparisons"][name]
        payload = load(path)
        entry = payload["comparisons"].setdefault(name, {"title": mine["title"], "setups": {}})
        entry["setups"][setup_name] = mine["setups"][setup_name]
        write(path, payload, smoke)
    return payload


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock on a file beside `path`, held while it is read and rewritten."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write(path: Path, payload: dict, smoke: bool) -> None:
    from everyprompt.report.stats import RULES

    for name, entry in payload["comparisons"].items():
        entry["title"] = COMPARISONS[name].title  # the plan's, should it have been reworded
        for setup_name, body in entry["setups"].items():
            body["contrasts"] = contrasts(COMPARISONS[name], setup_name, body["arms"])
            body["seeds"] = list(COMPARISONS[name].seeds_on(setup_name))
    payload["rules"] = {key: f"{rule.name} ({rule.since})" for key, rule in RULES.items()}
    payload["smoke"] = smoke
    write_results(path, payload)


def merge_file(path: Path, other: Path) -> int:
    """`--merge`: `other`'s runs that `path` lacks added to it, every contrast rejudged; exit 2, naming the
    file and what conflicts, with nothing changed."""
    from bench.evidence.merge import MergeConflict, merge_from

    with locked(path):
        payload = load(path)
        try:
            added = merge_from(payload, other)
        except MergeConflict as err:
            print(f"--merge {other}: nothing merged: {err}", file=sys.stderr)
            return 2
        write(path, payload, payload.get("smoke", False))
    print(f"merged {len(added)} run(s) from {other} into {repo_path(path)}: {', '.join(added) or 'none new'}")
    return 0
