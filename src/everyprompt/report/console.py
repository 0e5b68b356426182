"""The console tables the commands print: held-out accuracy (`eval`, `demo`), a run's summary and a
comparison of runs (`report`), a sweep's cells (`sweep`) and a pass-rate histogram (`filter`)."""

from __future__ import annotations

from rich.table import Table

from everyprompt.report.compare import describe, describe_difference, summary
from everyprompt.report.summary import format_row


def _levels(results: dict[str, float]) -> list[str]:
    return sorted(k.split("/", 1)[1] for k in results if k.startswith("greedy_accuracy/"))


def eval_table(results: dict[str, float], pass_k: int) -> Table:
    """`everyprompt eval`: greedy pass@1, overall and per split of the held-out prompts (their level, or
    their reasoning-gym task), and sampled pass@k where the evaluation sampled (`eval.num_samples` > 0);
    the caption says what the rows are and why a column is absent."""
    table = Table(title=f"Held-out evaluation ({int(results['num_prompts'])} prompts)")
    key = f"pass@{pass_k}"
    sampled = key in results
    table.add_column("split")
    table.add_column("greedy pass@1", justify="right")
    if sampled:
        table.add_column(key, justify="right")
    notes = []
    splits = _levels(results)
    if splits:
        notes.append(
            "the splits are the held-out prompts by level or task (the config's data.levels or tasks)"
        )
    if not sampled:
        notes.append(f"no {key}: the config samples none (eval.num_samples=0); greedy only")
    table.caption = "; ".join(notes) or None
    for label, suffix in [("overall", "")] + [(split.replace("_", " "), "/" + split) for split in splits]:
        cells = [label, f"{results['greedy_accuracy' + suffix]:.1%}"]
        if sampled:
            value = results.get(key + suffix)
            cells.append("-" if value is None else f"{value:.1%}")
        table.add_row(*cells)
    return table


def accuracy_table(before: dict[str, float], after: dict[str, float], pass_key: str) -> Table:
    """`everyprompt demo`: held-out accuracy before and after RL, overall and per level (pass@k columns
    only when the evaluation sampled: `eval.num_samples` > 0)."""
    table = Table(title="Held-out accuracy before and after RL")
    sampled = pass_key in before and pass_key in after
    columns = ["split", "greedy before", "greedy after", "change"]
    for column in columns + ([f"{pass_key} before", f"{pass_key} after"] if sampled else []):
        table.add_column(column, justify="right")
    for label, suffix in [("overall", "")] + [(lvl.replace("_", " "), "/" + lvl) for lvl in _levels(before)]:
        b, a = before[f"greedy_accuracy{suffix}"], after[f"greedy_accuracy{suffix}"]
        cells = [label, f"{b:.1%}", f"{a:.1%}", f"{(a - b) * 100:+.1f} pt"]
        if sampled:
            cells += [f"{before[pass_key + suffix]:.1%}", f"{after[pass_key + suffix]:.1%}"]
        table.add_row(*cells)
    return table


def run_tables(report_summary: dict) -> list[Table]:
    """`everyprompt report RUN`: one table per phase (RL, SFT) of `report()`'s summary."""
    tables = []
    for name in ("rl", "sft"):
        part = report_summary.get(name)
        if part is None:
            continue
        table = Table(title=f"{name.upper()}: {part['steps']} steps")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for row in part["rows"]:
            table.add_row(
                row["label"],
                format_row(row) + (f" ({row['non_finite']} non-finite)" if row["non_finite"] else ""),
            )
        tables.append(table)
    return tables


def comparison_table(arms) -> Table:
    """`everyprompt report` over several runs: each arm's mean ± sd over seeds and its difference to the
    first arm with a bootstrap interval."""
    columns, rows = summary(arms)
    out = Table(title=f"{sum(len(a.runs) for a in arms)} runs, {len(arms)} arms (mean ± sd over seeds)")
    out.add_column("arm")
    out.add_column("runs", justify="right")
    for column in columns:
        out.add_column(column.label, justify="right", no_wrap=column.compare)  # an interval stays whole
    for arm, entries in zip(arms, rows):
        cells = []
        for column, entry in zip(columns, entries):
            difference = describe_difference(entry.difference, column.percent)
            cells.append(describe(entry, column.percent) + (f"\n{difference}" if difference else ""))
        out.add_row(arm.name, str(len(arm.runs)), *cells)
    out.caption = f"differences: to {arms[0].name}, with 95% bootstrap intervals over seeds"
    return out


def sweep_table(title: str, cells: list[tuple[str, str, float | None, float]]) -> Table:
    """`everyprompt sweep`: (cell, state, held-out greedy accuracy or None, seconds) per cell."""
    table = Table(title=title)
    for column in ("cell", "state", "held-out greedy", "minutes"):
        table.add_column(column, justify="left" if column == "cell" else "right")
    for name, state, accuracy, seconds in cells:
        table.add_row(
            name,
            state,
            f"{accuracy:.1%}" if accuracy is not None else "-",
            f"{seconds / 60:.1f}" if seconds else "-",
        )
    return table


def level_table(by_level: dict[str, dict[str, float]], band: tuple[float, float]) -> Table:
    """`everyprompt filter`: per difficulty level, how the prompts' pass rates spread."""
    table = Table(title="Pass rates by level")
    for name in (
        "level",
        "prompts",
        "mean pass rate",
        "never solved",
        "always solved",
        f"{band[0]:g}-{band[1]:g}",
    ):
        table.add_column(name, justify="right")
    for level, row in by_level.items():
        table.add_row(
            level,
            str(int(row["prompts"])),
            f"{row['mean_pass_rate']:.2f}",
            f"{row['never_solved']:.0%}",
            f"{row['always_solved']:.0%}",
            f"{row['in_band']:.0%}",
        )
    return table


def histogram_table(histogram: dict[str, int], prompts: int, samples: int) -> Table:
    """`everyprompt filter`: how many prompts have each estimated pass rate."""
    table = Table(title=f"Pass rates of {prompts} prompts, {samples} samples each")
    table.add_column("pass rate", justify="right")
    table.add_column("prompts", justify="right")
    for value, count in histogram.items():
        table.add_row(value, str(count))
    return table


def recipes_table(where: str, recipes: list[tuple[str, str]]) -> Table:
    """The recipes shipped with the package: (name, its one-line summary), and the folder they are in."""
    table = Table(title=f"recipes ({where})", title_justify="left")
    table.add_column("name", style="bold", no_wrap=True)
    table.add_column("what it runs")
    for name, line in recipes:
        table.add_row(name, line)
    return table
