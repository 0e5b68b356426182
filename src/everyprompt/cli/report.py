"""`everyprompt report`: one run's summary and curves, or several runs and sweeps side by side."""

from __future__ import annotations

import sys
from pathlib import Path

from everyprompt.run.layout import REPORT_HTML, RunLayout, SweepLayout


def cmd_report(args) -> int:
    from rich.console import Console

    paths = [Path(p) for p in args.runs]
    from everyprompt.report.evidence import is_evidence

    if len(paths) == 1 and is_evidence(paths[0]):
        return _report_evidence(paths[0], args.html)
    single = len(paths) == 1 and not SweepLayout(paths[0]).is_sweep()
    if single:
        _report_one(paths[0])
    if args.html is None and single:
        return 0
    from everyprompt.report.console import comparison_table
    from everyprompt.report.html import write_html
    from everyprompt.report.runs import arms_of, load_runs

    runs = load_runs(paths)
    arms = arms_of(runs)
    console = Console(width=None if sys.stdout.isatty() else 160)
    if not single:
        console.print(comparison_table(arms))
    if args.html is not None:
        title = f"everyprompt report: {', '.join(p.name for p in paths)}"
        written = write_html(runs, arms, _html_target(args.html, paths, single), title)
        console.print(f"wrote {written} (one file: figures inline, opens from disk)")
    else:
        console.print(f"`everyprompt report {' '.join(args.runs)} --html` adds the curves, in one HTML file")
    return 0


def _report_evidence(path: Path, html: str | None) -> int:
    """An evidence file (bench/evidence/): its contrasts on the console; with --html, the evidence page
    (default: beside the file, as .html)."""
    import json

    from rich.console import Console

    from everyprompt.report.evidence import evidence_table, render_evidence
    from everyprompt.run.files import write_text_atomic

    payload = json.loads(path.read_text())
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(evidence_table(payload))
    if html is not None:
        target = Path(html) if html else path.with_suffix(".html")
        write_text_atomic(target, render_evidence(payload))
        console.print(f"wrote {target} (one file: figures inline, opens from disk)")
    return 0


def _html_target(given: str, paths: list[Path], single: bool) -> Path:
    """--html's file: as given, else RUN/report/report.html, SWEEP/report.html or ./report.html."""
    if given:
        return Path(given)
    if single:
        return RunLayout(paths[0]).report_html
    if len(paths) == 1:
        return SweepLayout(paths[0]).report_html
    return Path(REPORT_HTML)  # several directories: in the working directory


def _report_one(run_dir: Path) -> None:
    """The single-run report: tables on the console, summary.md / summary.json / curves in RUN/report/."""
    from rich.console import Console

    from everyprompt.report import report
    from everyprompt.report.console import run_tables

    summary = report(run_dir)
    console = Console()
    for table in run_tables(summary):
        console.print(table)
    demo = summary.get("demo")
    if demo:
        console.print(
            f"demo: held-out greedy accuracy {demo['accuracy_before_rl']:.1%} -> {demo['accuracy_after_rl']:.1%}"
        )
    layout = RunLayout(run_dir)
    files = [layout.report_summary.name, layout.report_markdown.name] + [
        p["curves"] for p in (summary.get("rl"), summary.get("sft")) if p and p["curves"]
    ]
    console.print(f"wrote {layout.report}/: {', '.join(files)}")


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "report", help="a run's summary and curves; several runs or a sweep side by side (--html: one file)"
    )
    p.add_argument(
        "runs",
        nargs="+",
        metavar="RUN_OR_SWEEP",
        help="run directories and/or sweep directories, or an evidence file (the JSON bench/evidence/ writes)",
    )
    p.add_argument(
        "--html",
        nargs="?",
        const="",
        default=None,
        metavar="REPORT.html",
        help="write one self-contained HTML page (default: SWEEP/report.html, RUN/report/report.html)",
    )
    p.set_defaults(func=cmd_report)
