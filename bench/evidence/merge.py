"""Records made elsewhere (a lent GPU's copy of the evidence file) merged into this one: `python -m
bench.evidence --merge FILE`. A record is one (comparison, set-up, arm, seed) run; the ones FILE has and
this file lacks are added, a run both have must be the same record, and nothing is removed."""

from __future__ import annotations

import json
from pathlib import Path

from bench.evidence.plan import COMPARISONS
from everyprompt.report.evidence import arm_runs, rows


class MergeConflict(ValueError):
    """The other file cannot be merged: unreadable, smoke runs, or runs that contradict this file's."""


def _conflicts(ours: dict, theirs: dict) -> list[str]:
    """What keeps `theirs` out of `ours`: comparisons the plan does not have, and set-ups or arms both files
    hold that ran with other settings (fixed overrides, an arm's own)."""
    problems = [
        f"{name}: no such comparison in the plan" for name, _, _, _ in rows(theirs) if name not in COMPARISONS
    ]
    mine = {(name, setup_name): body for name, _, setup_name, body in rows(ours)}
    for name, _, setup_name, body in rows(theirs):
        held = mine.get((name, setup_name))
        if held is None:
            continue
        if held.get("fixed") and body.get("fixed") != held["fixed"]:
            problems.append(
                f"{name}/{setup_name}: fixed settings {body.get('fixed')} against {held['fixed']}"
            )
        for arm, runs in body.get("arms", {}).items():
            other = held.get("arms", {}).get(arm)
            if other is not None and other.get("overrides") != runs.get("overrides"):
                problems.append(
                    f"{name}/{setup_name}/{arm}: overrides {runs.get('overrides')} against {other['overrides']}"
                )
    return problems


def merge(ours: dict, theirs: dict) -> list[str]:
    """Add to `ours` (an evidence payload) every run `theirs` records that `ours` lacks, with the arm's
    overrides and the set-up's fixed settings and teacher where `ours` has none; the runs added, as
    `comparison/set-up/arm seed N`. MergeConflict, before any change, when `theirs` holds smoke runs, a
    comparison the plan lacks, a run both record differently, or an arm both ran with other settings."""
    if theirs.get("smoke") and not ours.get("smoke"):
        raise MergeConflict("the other file holds smoke runs (--tiny); they do not go into the real record")
    problems = _conflicts(ours, theirs)
    recorded = dict(arm_runs(ours))
    new = []
    for key, record in arm_runs(theirs):
        if key not in recorded:
            new.append((key, record))
        elif recorded[key] != record:
            problems.append(f"{'/'.join(key[:3])} seed {key[3]}: two different records")
    if problems:
        raise MergeConflict("; ".join(problems))
    for (name, setup_name, arm, _), record in new:
        source = theirs["comparisons"][name]["setups"][setup_name]
        entry = ours.setdefault("comparisons", {}).setdefault(name, {"title": "", "setups": {}})
        body = entry["setups"].setdefault(setup_name, {"arms": {}})
        body.update({key: source[key] for key in ("fixed", "teacher") if key in source and key not in body})
        held = body["arms"].setdefault(
            arm, {"overrides": source["arms"][arm].get("overrides", []), "runs": []}
        )
        held["runs"] = sorted([*held["runs"], record], key=lambda r: r["seed"])
    return [f"{name}/{setup_name}/{arm} seed {seed}" for (name, setup_name, arm, seed), _ in new]


def merge_from(ours: dict, other: Path) -> list[str]:
    """`merge` of the evidence file at `other` into `ours`; MergeConflict when it cannot be read."""
    try:
        theirs = json.loads(other.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise MergeConflict(f"not an evidence file ({err})") from None
    if not isinstance(theirs, dict) or not isinstance(theirs.get("comparisons"), dict):
        raise MergeConflict("not an evidence file (no comparisons)")
    return merge(ours, theirs)
