"""One self-contained HTML file comparing runs: styles and figures inline, no script, no network; it opens
from disk in any browser and can be mailed as it is."""

from __future__ import annotations

import base64
import os
from datetime import datetime
from html import escape
from pathlib import Path

from everyprompt.report.compare import describe, describe_difference, figures, fmt, levels, summary
from everyprompt.report.runs import Arm, RunRecord, differing_keys

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; padding: 0 1em }
h1 { font-size: 1.5em } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd }
table { border-collapse: collapse; margin: .6em 0 } td, th { border: 1px solid #ccc; padding: .3em .6em }
th { background: #f3f3f3; text-align: left } td.num { text-align: right; white-space: nowrap }
.diff { color: #555; font-size: .9em } .muted { color: #777 } code { background: #f5f5f5; padding: 0 .2em }
figure { margin: 1em 0 } figure img { max-width: 100%; border: 1px solid #eee }
figcaption { font-weight: 600; margin-bottom: .3em } .state-failed { color: #b00020 }
details { margin: .3em 0 } pre { background: #f8f8f8; padding: .5em; overflow-x: auto; font-size: .85em }
"""


def html_table(head: list[str], rows: list[list[str]], numeric_from: int = 1, table_id: str = "") -> str:
    ident = f' id="{table_id}"' if table_id else ""
    lines = [
        f"<table{ident}><thead><tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr></thead><tbody>"
    ]
    for row in rows:
        cells = [
            f'<td class="num">{cell}</td>' if i >= numeric_from else f"<td>{cell}</td>"
            for i, cell in enumerate(row)
        ]
        lines.append("<tr>" + "".join(cells) + "</tr>")
    return "\n".join(lines) + "</tbody></table>"


def html_figure(caption: str, png: bytes, ident: str = "") -> str:
    """A PNG inline (base64) under its caption: the page needs no file beside it."""
    data = base64.b64encode(png).decode("ascii")
    attribute = f' id="{escape(ident)}"' if ident else ""
    return (
        f"<figure{attribute}><figcaption>{escape(caption)}</figcaption>"
        f'<img alt="{escape(caption)}" src="data:image/png;base64,{data}"></figure>'
    )


def _runs_section(runs: list[RunRecord], arms: list[Arm]) -> str:
    arm_of = {id(run): arm.name for arm in arms for run in arm.runs}
    rows = []
    for run in runs:
        steps = run.rl.steps[-1] if run.rl is not None and run.rl.records else 0
        rows.append(
            [
                escape(run.name),
                escape(arm_of[id(run)]),
                escape(run.seed),
                f'<span class="state-{escape(run.state)}">{escape(run.state)}</span>',
                str(steps),
                f"<code>{escape(str(run.path))}</code>",
            ]
        )
    return html_table(["run", "arm", "seed", "state", "RL steps", "directory"], rows, numeric_from=6)


def _differing_section(runs: list[RunRecord]) -> str:
    keys = differing_keys(runs)
    if not keys:
        return "<p>Every run has the same config.</p>"
    rows = [
        [f"<code>{escape(k)}</code>", *(escape(run.config.get(k, "(absent)")) for run in runs)] for k in keys
    ]
    return html_table(
        ["config key", *(run.name for run in runs)], rows, numeric_from=len(runs) + 1, table_id="keys"
    )


def _summary_section(arms: list[Arm]) -> str:
    columns, table = summary(arms)
    if not columns:
        return "<p>No run has a held-out evaluation or training metrics yet.</p>"
    rows = []
    for arm, entries in zip(arms, table):
        row = [escape(arm.name), str(len(arm.runs))]
        for column, entry in zip(columns, entries):
            text = escape(describe(entry, column.percent))
            difference = describe_difference(entry.difference, column.percent)
            if difference:
                text += f'<br><span class="diff">{escape(difference)} vs {escape(arms[0].name)}</span>'
            row.append(text)
        rows.append(row)
    head = ["arm", "runs", *(c.label for c in columns)]
    names, per_level = levels(arms)
    html = html_table(head, rows, numeric_from=1, table_id="summary")
    html += (
        '<p class="muted">mean ± sample sd over seeds; under the other arms, their difference to the first arm '
        "with a 95% percentile-bootstrap interval (each arm's seeds resampled, 10,000 draws). "
        "Final figures are the held-out evaluation after each run's last step.</p>"
    )
    if names:
        rows = [
            [escape(arm.name), *(escape(_spread(s)) for s in spreads)]
            for arm, spreads in zip(arms, per_level)
        ]
        html += "<h3>Held-out greedy accuracy per level</h3>"
        html += html_table(["arm", *(n.replace("_", " ") for n in names)], rows, table_id="levels")
    return html


def _spread(spread) -> str:
    if not spread.n:
        return "–"
    return fmt(spread.mean, True) + (f" ± {spread.sd:.1%}" if spread.n > 1 else "")


def _problems_section(runs: list[RunRecord]) -> str:
    parts = []
    for run in runs:
        if not run.warnings and not run.errors:
            continue
        counted = ", ".join(f"{key}: {fmt(value)}" for key, value in run.errors.items())
        summary = f"{escape(run.name)}: {len(run.warnings)} warnings" + (
            f"; {escape(counted)}" if counted else ""
        )
        body = "\n".join(run.warnings[-200:]) if run.warnings else "(no warnings)"
        parts.append(f"<details><summary>{summary}</summary><pre>{escape(body)}</pre></details>")
    return "\n".join(parts) or "<p>No warnings and no counted errors.</p>"


def render(runs: list[RunRecord], arms: list[Arm], title: str) -> str:
    """The whole report page as one string."""
    sections = [
        f"<h1>{escape(title)}</h1>",
        f'<p class="muted">{len(runs)} runs in {len(arms)} arms; drawn '
        f"{datetime.now().strftime('%Y-%m-%d %H:%M')} by <code>everyprompt report</code></p>",
        "<h2>Runs</h2>",
        _runs_section(runs, arms),
        "<h2>Config keys that differ</h2>",
        _differing_section(runs),
        "<h2>Summary</h2>",
        _summary_section(arms),
        "<h2>Curves</h2>",
        '<p class="muted">each arm: the mean over its seeds (per-step series over 20 steps smoothed by a moving '
        "mean over a tenth of the run), the shaded band the seeds' range.</p>",
    ]
    sections += [html_figure(name, png, f"figure-{index}") for index, (name, png) in enumerate(figures(arms))]
    sections += ["<h2>Warnings and counted errors</h2>", _problems_section(runs)]
    body = "\n".join(sections)
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f"<style>{STYLE}</style></head><body>\n{body}\n</body></html>\n"
    )


def write_html(runs: list[RunRecord], arms: list[Arm], path: Path, title: str) -> Path:
    """Write the page atomically (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(render(runs, arms, title), encoding="utf-8")
    os.replace(temporary, path)
    return path
