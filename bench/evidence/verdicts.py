"""docs/evidence.md's verdicts from recorded runs: each contrast paired by seed and judged by the rule in
force (amended 2026-11-27: a paired t-test, Holm within a comparison) with the rule as first written
beside it, and the README's claims table made from them (bench/evidence/ runs, records and writes)."""

from __future__ import annotations

from pathlib import Path

from bench.common import ROOT
from bench.evidence.plan import COMPARISONS, Comparison


def contrasts(comparison: Comparison, setup_name: str, arms: dict[str, dict]) -> list[dict]:
    """Each judged and reported contrast from the recorded runs, paired by seed, under the rule in force
    (docs/evidence.md, amended 2026-11-27: a paired t-test, Holm within the comparison's judged contrasts,
    at least MIN_PAIRS pairs) and, beside it, the rule as first written (a percentile bootstrap of the
    first pre-registered seeds). A verdict waits for every pre-registered seed of the family's contrasts;
    until then `status` says which seeds each side lacks."""
    from everyprompt.report.stats import MIN_PAIRS, holm, paired_bootstrap, paired_t, t_verdict, verdict

    wanted, first = comparison.seeds_on(setup_name), comparison.first_seeds_on(setup_name)
    pairs = [(arm, reference, True) for arm, reference in comparison.judged_contrasts()]
    pairs += [(arm, reference, False) for arm, reference in comparison.reported]
    out = []
    for arm, reference, judged in pairs:
        mine = {r["seed"]: r["greedy_accuracy"] for r in arms.get(arm, {}).get("runs", [])}
        theirs = {r["seed"]: r["greedy_accuracy"] for r in arms.get(reference, {}).get("runs", [])}
        seeds = sorted(set(mine) & set(theirs))
        differences = [mine[s] - theirs[s] for s in seeds]
        test = paired_t(differences)
        lacking = {side: sorted(set(wanted) - set(runs)) for side, runs in ((arm, mine), (reference, theirs))}
        lacking = {side: missing for side, missing in lacking.items() if missing}
        first_pairs = [s for s in seeds if s in first]
        original = paired_bootstrap([mine[s] - theirs[s] for s in first_pairs])
        out.append(
            {
                "arm": arm,
                "reference": reference,
                "judged": judged,
                "seeds": seeds,
                "differences": differences,
                "mean_difference": test.value,
                "interval": None if test.low is None else [test.low, test.high],
                "p": test.p,
                "p_holm": None,
                "complete": not lacking,
                "verdict": None,
                "status": _status(lacking, len(seeds), MIN_PAIRS),
                "as_first_written": {
                    "seeds": first_pairs,
                    "mean_difference": original.value,
                    "interval": None if original.low is None else [original.low, original.high],
                    "verdict": verdict(original) if judged and set(first) <= set(seeds) else None,
                },
            }
        )
    family = [c for c in out if c["judged"]]
    if family and all(c["status"] is None for c in family):
        for c, adjusted in zip(family, holm([c["p"] for c in family])):
            c["p_holm"], c["verdict"] = adjusted, t_verdict(c["mean_difference"], adjusted)
    else:
        for c in family:
            c["status"] = c["status"] or "waits for the other contrasts of its comparison (Holm's family)"
    return out


def _status(lacking: dict[str, list[int]], pairs: int, needed: int) -> str | None:
    """Why a contrast has no verdict yet (None: nothing stands in the way)."""
    if lacking:
        return "not enough seeds: " + "; ".join(f"{side} lacks {seeds}" for side, seeds in lacking.items())
    if pairs < needed:
        return f"not enough seeds: {pairs} pairs, the rule needs {needed}"
    return None


README = ROOT / "README.md"
MARKERS = ("<!-- claims-table -->", "<!-- /claims-table -->")


def claims_table(payload: dict) -> str:
    """The README's claims: every judged contrast of the pre-registered plan, as far as it has run, and
    each exploratory win that its confirmation on new seeds upheld (docs/evidence.md); each contrast
    judged from the recorded runs by the rule in force, with the rule as first written beside it."""
    from everyprompt.report.stats import RULES

    lines = [
        "| comparison | set-up | contrast | seed pairs | mean, points | 95% t-interval | p (Holm) | verdict "
        "| as first written |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    recorded = payload.get("comparisons", {})

    def found(name: str, setup_name: str) -> dict:
        arms = recorded.get(name, {}).get("setups", {}).get(setup_name, {}).get("arms", {})
        return {(c["arm"], c["reference"]): c for c in contrasts(COMPARISONS[name], setup_name, arms)}

    for name, comparison in COMPARISONS.items():
        for setup_name in comparison.setups:
            mine = found(name, setup_name)
            candidate = found(comparison.confirms, setup_name) if comparison.confirms else {}
            for arm, reference in comparison.judged_contrasts():
                c = mine.get((arm, reference))
                # the second step's: a claim only as a confirmation of a candidate's win (under the rule
                # in force when the confirmation was planned, or now)
                if comparison.exploratory and not (_won(c) and _won(candidate.get((arm, reference)))):
                    continue
                lines.append(
                    f"| {name.upper()} {comparison.title} | {setup_name} | {arm} - {reference} | "
                    + _cells(c, len(comparison.seeds_on(setup_name)))
                )
    amended, first = RULES["amended"], RULES["as-first-written"]
    lines.append(
        "\nThe plan, written before any run: docs/evidence.md. Held-out greedy accuracy after RL, the arm "
        f"minus the baseline seed by seed. Verdict by the rule amended {amended.since} ({amended.name}): a "
        "win or a loss when the Holm-adjusted p-value of the paired t-test is below 0.05, given once every "
        "pre-registered seed is in. As first written: the verdict of the plan's original rule "
        f"({first.name}) on its first seeds. `python -m bench.evidence --readme` writes this table from "
        "bench/results/evidence.json. The second, exploratory step (where ESPO might win) is on the evidence "
        "page; a win of it is listed here only once the same runs on new seeds confirm it."
    )
    return "\n".join(lines)


def _won(contrast: dict | None) -> bool:
    return contrast is not None and "win" in (contrast["verdict"], contrast["as_first_written"]["verdict"])


def _cells(contrast: dict | None, wanted: int) -> str:
    """A claims row's seed pairs, mean, interval, p-value and verdicts (or how far it has run)."""
    from everyprompt.report.evidence import interval_text, p_text, signed

    if contrast is None or not contrast["seeds"]:
        return "0 | – | – | – | not run yet | – |"
    seeds = len(contrast["seeds"])
    verdict = (
        f"**{contrast['verdict']}**" if contrast["verdict"] else f"incomplete ({seeds} of {wanted} seeds)"
    )
    first = contrast["as_first_written"]
    was = f"{first['verdict']} ({len(first['seeds'])} seeds)" if first["verdict"] else "–"
    return (
        f"{seeds} | {signed(contrast['mean_difference'])} | {interval_text(contrast)} | "
        f"{p_text(contrast)} | {verdict} | {was} |"
    )


def readme_section(text: str) -> str:
    start, end = (text.index(marker) for marker in MARKERS)
    return text[start + len(MARKERS[0]) : end].strip("\n")


def write_readme(payload: dict, readme: Path = README) -> None:
    text = readme.read_text()
    start, end = (text.index(marker) for marker in MARKERS)
    readme.write_text(text[: start + len(MARKERS[0])] + "\n" + claims_table(payload) + "\n" + text[end:])
