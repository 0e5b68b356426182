"""C7's curve (docs/evidence.md: secondary, not judged): each arm's held-out greedy accuracy at each mark of
its training clock, from the starting model's figure at 0 s, as a table of means over the recorded seeds
(with the steps each arm had completed by each mark) and as a figure with every seed's line beside the
mean. Made from the records alone (bench/results/evidence.json):

    python -m bench.time_to_accuracy --curve           # the table, and bench/results/c7_curve.png
"""

from __future__ import annotations

import statistics
from pathlib import Path


def points(body: dict, arm: str) -> list[dict]:
    """An arm's recorded runs as curves: per seed, (seconds, accuracy, steps) from 0 s (the starting
    model, no steps) through each mark of the body."""
    start = body["start"]["greedy_accuracy"]
    curves = []
    for run in body["arms"][arm]["runs"]:
        marks = [(0.0, start, 0)]
        for mark in body["marks_s"]:
            key = f"{mark:g}"
            marks.append((mark, run["greedy_accuracy_by_seconds"][key], run["steps_by_seconds"][key]))
        curves.append({"seed": run["seed"], "marks": marks})
    return curves


def curve_table(body: dict) -> str:
    """Markdown: an arm a row; at 0 s and at each mark, the mean held-out accuracy over its recorded seeds
    and the mean steps completed by then."""
    marks = [0.0, *body["marks_s"]]
    head = " | ".join(f"{mark:g} s" for mark in marks)
    lines = [f"| arm | seeds | {head} |", "|---|---|" + "---|" * len(marks)]
    for arm in body["arms"]:
        curves = points(body, arm)
        if not curves:
            lines.append(f"| {arm} | 0 |" + " – |" * len(marks))
            continue
        cells = []
        for i in range(len(marks)):
            accuracy = statistics.fmean(c["marks"][i][1] for c in curves)
            steps = statistics.fmean(c["marks"][i][2] for c in curves)
            cells.append(f"{accuracy:.1%} ({steps:.1f} steps)" if i else f"{accuracy:.1%}")
        lines.append(f"| {arm} | {len(curves)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(body: dict, path: Path, title: str) -> None:
    """Accuracy against seconds of training (each seed faint, the mean bold) and steps against seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (accuracy_axes, steps_axes) = plt.subplots(1, 2, figsize=(11, 4.2))
    for index, arm in enumerate(body["arms"]):
        curves = points(body, arm)
        if not curves:
            continue
        color = f"C{index}"
        seconds = [m[0] for m in curves[0]["marks"]]
        for curve in curves:
            accuracy_axes.plot(seconds, [100 * m[1] for m in curve["marks"]], color=color, alpha=0.25, lw=1)
        mean = [100 * statistics.fmean(c["marks"][i][1] for c in curves) for i in range(len(seconds))]
        accuracy_axes.plot(
            seconds, mean, color=color, lw=2.2, marker="o", label=f"{arm} ({len(curves)} seeds)"
        )
        steps = [statistics.fmean(c["marks"][i][2] for c in curves) for i in range(len(seconds))]
        steps_axes.plot(seconds, steps, color=color, lw=2.2, marker="o", label=arm)
    accuracy_axes.set(xlabel="seconds of training", ylabel="held-out greedy accuracy, %", title=title)
    steps_axes.set(xlabel="seconds of training", ylabel="RL steps completed", title="steps by each mark")
    for axes in (accuracy_axes, steps_axes):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
