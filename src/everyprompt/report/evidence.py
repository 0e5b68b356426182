"""The evidence page: pre-registered comparisons read from an evidence file (the JSON `python -m
bench.evidence` writes; the plan is docs/evidence.md).

The file holds, per comparison and set-up, each arm's runs (one per seed: its held-out greedy accuracy and
more) and the contrasts: an arm against its reference, paired by seed, the mean of the per-seed
differences, its 95% t-interval, the p-value of the paired t-test and its Holm adjustment within the
comparison and, for a judged contrast whose family has every pre-registered seed, the verdict (win / loss
/ no difference shown) by the rule as amended 2026-11-27; beside it the verdict of the rule as first
written (a percentile bootstrap). The page shows them as they are and draws each arm's per-seed points,
the seeds joined across arms, beside each contrast's interval.
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

from everyprompt.report.compare import png_of
from everyprompt.report.html import STYLE, html_figure, html_table

KIND = "evidence"  # the file's `benchmark`


def is_evidence(path: Path) -> bool:
    """Whether `path` is an evidence file (a JSON file whose `benchmark` is "evidence")."""
    if path.suffix != ".json" or not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("benchmark") == KIND
    except (ValueError, AttributeError):
        return False


def _points(value) -> str:
    return "–" if value is None or value != value else f"{100 * value:.1f}"


def signed(value) -> str:
    """A difference of fractions in signed points ("–" when there is none)."""
    return "–" if value is None or value != value else f"{100 * value:+.1f}"


def interval_text(contrast: dict) -> str:
    """A contrast's interval in signed points, "[low, high]" ("–" without one)."""
    interval = contrast["interval"]
    return f"[{signed(interval[0])}, {signed(interval[1])}]" if interval else "–"


def p_text(contrast: dict) -> str:
    """A contrast's p-value and, for a judged one, its Holm adjustment: "0.044 (0.088)"."""
    p, adjusted = contrast.get("p"), contrast.get("p_holm")
    if p is None:
        return "–"
    return f"{p:.3f}" + (f" ({adjusted:.3f})" if adjusted is not None else "")


def said(contrast: dict) -> str:
    """A contrast's verdict as the page words it (or why it has none yet)."""
    if not contrast["judged"]:
        return "reported, not judged"
    return (
        contrast["verdict"]
        or contrast.get("status")
        or f"incomplete ({len(contrast['seeds'])} seed pairs so far)"
    )


def first_said(contrast: dict) -> str:
    """The verdict of the rule as first written, with its seeds ("–" for none)."""
    first = contrast.get("as_first_written") or {}
    if not first.get("verdict"):
        return "–"
    return f"{first['verdict']} ({len(first['seeds'])} seeds, {interval_text(first)})"


def rows(payload: dict):
    """(comparison, title, set-up, body) of every comparison and set-up in the file, in its order: how the
    file is laid out, read in this one place (the page here, and bench/evidence's merging)."""
    for name, entry in payload.get("comparisons", {}).items():
        for setup, body in entry.get("setups", {}).items():
            yield name, entry.get("title", ""), setup, body


def arm_runs(payload: dict):
    """((comparison, set-up, arm, seed), run record) of every run the file records, in its order."""
    for name, _, setup, body in rows(payload):
        for arm, held in body.get("arms", {}).items():
            for record in held.get("runs", []):
                yield (name, setup, arm, record["seed"]), record


def _figure(body: dict) -> bytes | None:
    """Per-seed held-out accuracy of each arm (the same seed joined across arms), and each contrast's mean
    paired difference with its interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = body["arms"]
    if not any(a["runs"] for a in arms.values()):
        return None
    contrasts = body.get("contrasts", [])
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4), gridspec_kw={"width_ratios": [3, 2]})
    names = list(arms)
    by_seed: dict[int, dict[int, float]] = {}
    for x, name in enumerate(names):
        for run in arms[name]["runs"]:
            by_seed.setdefault(run["seed"], {})[x] = 100 * run["greedy_accuracy"]
    for _, points in sorted(by_seed.items()):
        xs = sorted(points)
        left.plot(xs, [points[x] for x in xs], color="#bbb", linewidth=0.8, zorder=1)
        left.scatter(xs, [points[x] for x in xs], s=14, zorder=2)
    left.set_xticks(range(len(names)), names, fontsize=8)
    left.set_ylabel("held-out greedy accuracy, %", fontsize=8)
    left.set_title("per seed (lines join a seed across arms)", fontsize=9)
    for y, contrast in enumerate(contrasts):
        mean, interval = contrast["mean_difference"], contrast["interval"]
        if mean != mean:
            continue
        if interval:
            low, high = 100 * (mean - interval[0]), 100 * (interval[1] - mean)
            right.errorbar(100 * mean, y, xerr=[[low], [high]], fmt="o", capsize=3)
        else:
            right.plot(100 * mean, y, "o")
    right.axvline(0, color="#888", linewidth=0.8)
    right.set_yticks(range(len(contrasts)), [f"{c['arm']} - {c['reference']}" for c in contrasts], fontsize=8)
    right.set_xlabel("mean paired difference, points (95% interval)", fontsize=8)
    right.set_title("contrasts", fontsize=9)
    for axis in (left, right):
        axis.tick_params(labelsize=8)
    return png_of(figure)


def _section(name: str, title: str, setup: str, body: dict) -> str:
    arms = body["arms"]
    arm_rows = []
    for arm, entry in arms.items():
        runs = sorted(entry["runs"], key=lambda r: r["seed"])
        values = [r["greedy_accuracy"] for r in runs]
        mean = sum(values) / len(values) if values else None
        arm_rows.append(
            [
                escape(arm),
                " ".join(f"<code>{escape(o)}</code>" for o in entry.get("overrides", [])),
                str(len(runs)),
                escape(" ".join(f"{r['seed']}: {_points(r['greedy_accuracy'])}" for r in runs) or "–"),
                _points(mean),
            ]
        )
    html = [
        f'<h2 id="{escape(name)}-{escape(setup)}">{escape(name.upper())}: {escape(title)}, {escape(setup)}</h2>'
    ]
    html.append(html_table(["arm", "its keys", "seeds", "held-out greedy %, by seed", "mean %"], arm_rows, 2))
    contrast_rows = [
        [
            escape(f"{c['arm']} - {c['reference']}"),
            str(len(c["seeds"])),
            escape(" ".join(signed(d) for d in c["differences"]) or "–"),
            signed(c["mean_difference"]),
            escape(interval_text(c)),
            escape(p_text(c)),
            f"<strong>{escape(said(c))}</strong>",
            escape(first_said(c)),
        ]
        for c in body.get("contrasts", [])
    ]
    head = ["contrast", "seed pairs", "differences, points", "mean", "95% t-interval", "p (Holm)", "verdict",
            "as first written"]  # fmt: skip
    html.append(html_table(head, contrast_rows, 1))
    png = _figure(body)
    if png is not None:
        html.append(html_figure(f"{name.upper()}, {setup}", png))
    return "\n".join(html)


def render_evidence(payload: dict, title: str = "everyprompt evidence") -> str:
    """The evidence page as one self-contained HTML string."""
    smoke = " (a smoke run on a 2-layer model: not evidence)" if payload.get("smoke") else ""
    sections = [
        f"<h1>{escape(title)}{escape(smoke)}</h1>",
        '<p class="muted">The plan, written before any run: <code>docs/evidence.md</code>. Per contrast: the '
        "arm minus its reference, seed by seed; the mean of those differences, its 95% Student-t interval and "
        "the paired t-test's p-value, adjusted by Holm within the comparison's judged contrasts. Verdict (the "
        "rule as amended 2026-11-27): a win or a loss, by the sign of the mean, when the adjusted p-value is "
        "below 0.05, otherwise no difference shown; given once every pre-registered seed is in, on 3 seed "
        "pairs at least. As first written: the original rule's verdict (a win when the 95% "
        "percentile-bootstrap interval of the first seeds lies above 0, a loss when below).</p>",
    ]
    found = list(rows(payload))
    sections += [_section(*row) for row in found] or ["<p>No comparison recorded yet.</p>"]
    body = "\n".join(sections)
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f"<style>{STYLE}</style></head><body>\n{body}\n</body></html>\n"
    )


def evidence_table(payload: dict):
    """The contrasts as one rich table (the console's view of the page)."""
    from rich.table import Table

    table = Table(title="pre-registered contrasts (docs/evidence.md)")
    columns = ("comparison", "set-up", "contrast", "pairs", "mean, pt", "95% t-interval", "p (Holm)",
               "verdict", "as first written")  # fmt: skip
    for column in columns:
        table.add_column(column)
    for name, _, setup, body in rows(payload):
        for c in body.get("contrasts", []):
            table.add_row(
                name, setup, f"{c['arm']} - {c['reference']}", str(len(c["seeds"])),
                signed(c["mean_difference"]), interval_text(c), p_text(c), said(c), first_said(c),
            )  # fmt: skip
    return table
