"""Reading what runs wrote: a run's report (summary.py: `everyprompt report RUN_DIR`), runs side by side
(runs.py, compare.py), the HTML page (html.py), the console's tables (console.py), the statistics of
comparisons (stats.py) and the evidence file's reading (evidence.py). This module only re-exports the
report's names.
"""

from __future__ import annotations

from everyprompt.report.summary import (
    PANELS,
    REDUCTIONS,
    ROWS,
    Metrics,
    ReportError,
    finite_mean,
    format_row,
    load_metrics,
    markdown,
    moving_average,
    plot,
    read_config,
    report,
    summarize,
)

__all__ = [
    "Metrics",
    "PANELS",
    "REDUCTIONS",
    "ROWS",
    "ReportError",
    "finite_mean",
    "format_row",
    "load_metrics",
    "markdown",
    "moving_average",
    "plot",
    "read_config",
    "report",
    "summarize",
]
