"""Records made elsewhere (a lent GPU's copy of the evidence file) merged into this one: `python
bench/evidence.py --merge FILE`. A record is one (comparison, set-up, arm, seed) run; the ones FILE has and
this file lacks are added, a run both have must be the same record, and nothing is removed."""

from __future__ import annotations

import json
from pathlib import Path


class MergeConflict(ValueError):
    """Two files hold different records of one run."""


def merge(ours: dict, theirs: dict) -> list[str]:
    """Add to `ours` (an evidence payload) every run `theirs` records that `ours` lacks, with the arm's
    overrides and the set-up's fixed settings and teacher where `ours` has none; the runs added, as
    `comparison/set-up/arm seed N`. MergeConflict, before any change, when a run both record differs or
    when the same arm ran with other settings."""
    if theirs.get("smoke") and not ours.get("smoke"):
        raise MergeConflict("the other file holds smoke runs (--tiny); they do not go into the real record")
    additions: list[tuple[str, str, str, dict]] = []
    problems: list[str] = []
    for name, entry in theirs.get("comparisons", {}).items():
        mine_entry = ours.get("comparisons", {}).get(name, {})
        for setup_name, body in entry.get("setups", {}).items():
            mine = mine_entry.get("setups", {}).get(setup_name)
            where = f"{name}/{setup_name}"
            if mine is not None and mine.get("fixed") and body.get("fixed") != mine.get("fixed"):
                problems.append(f"{where}: fixed settings {body.get('fixed')} against {mine.get('fixed')}")
            for arm, runs in body.get("arms", {}).items():
                held = (mine or {}).get("arms", {}).get(arm)
                if held is not None and held.get("overrides") != runs.get("overrides"):
                    problems.append(
                        f"{where}/{arm}: overrides {runs.get('overrides')} against {held['overrides']}"
                    )
                by_seed = {r["seed"]: r for r in (held or {}).get("runs", [])}
                for record in runs.get("runs", []):
                    known = by_seed.get(record["seed"])
                    if known is None:
                        additions.append((name, setup_name, arm, record))
                    elif known != record:
                        problems.append(f"{where}/{arm} seed {record['seed']}: two different records")
    if problems:
        raise MergeConflict("; ".join(problems))
    added = []
    for name, setup_name, arm, record in additions:
        source = theirs["comparisons"][name]
        entry = ours.setdefault("comparisons", {}).setdefault(
            name, {"title": source.get("title"), "setups": {}}
        )
        body = entry["setups"].setdefault(setup_name, {"arms": {}})
        source_body = source["setups"][setup_name]
        for key in ("fixed", "teacher"):
            if key in source_body and key not in body:
                body[key] = source_body[key]
        held = body["arms"].setdefault(
            arm, {"overrides": source_body["arms"][arm].get("overrides", []), "runs": []}
        )
        held["runs"].append(record)
        held["runs"].sort(key=lambda r: r["seed"])
        added.append(f"{name}/{setup_name}/{arm} seed {record['seed']}")
    return added


def merge_from(ours: dict, other: Path) -> list[str]:
    """`merge` of the evidence file at `other` into `ours`; MergeConflict when it cannot be read."""
    try:
        theirs = json.loads(other.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise MergeConflict(f"not an evidence file ({err})") from None
    if not isinstance(theirs, dict) or not isinstance(theirs.get("comparisons"), dict):
        raise MergeConflict("not an evidence file (no comparisons)")
    return merge(ours, theirs)
