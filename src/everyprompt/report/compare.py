"""Arms side by side: the summary table (mean ± sd over seeds, each arm's difference to the first arm
with a bootstrap interval) and the curves (each arm's mean over its seeds, the band their range)."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, replace

from everyprompt.report.runs import Arm, RunRecord
from everyprompt.report.stats import Difference, Spread, bootstrap_difference, finite
from everyprompt.report.summary import REDUCTIONS, distinct, finite_mean, moving_average

FINAL = "final"  # a column's figure from the held-out eval after the last step
INITIAL = "initial"  # from the held-out eval before the first RL step (where the run made one: a demo)


@dataclass(frozen=True)
class Column:
    label: str
    key: str
    how: str  # FINAL, or a REDUCTIONS entry over the run's steps ("last tenth", "mean", "median", "max")
    percent: bool = False
    compare: bool = False  # show the difference to the first arm with its interval


COLUMNS = (
    Column("held-out greedy before RL", "greedy_accuracy", INITIAL, percent=True),
    Column("held-out greedy", "greedy_accuracy", FINAL, percent=True, compare=True),
    Column("held-out pass@k", "pass@k", FINAL, percent=True, compare=True),
    Column("training accuracy (last tenth)", "reward/accuracy", "last tenth", percent=True),
    Column("zero-variance rate", "zve/zero_variance_rate", "mean", percent=True),
    Column("entropy (last tenth)", "actor/entropy", "last tenth"),
    Column("s / step", "time/step_s", "median"),
    Column("peak GiB", "memory/peak_rss_gib", "max"),
)

# (figure title, metric keys: one panel each, those no run logged left out)
FIGURES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("training reward", ("reward/mean", "reward/accuracy")),
    ("held-out greedy accuracy", ("eval/greedy_accuracy",)),
    (
        "zero-variance rate per ZVE stage",
        (
            "zve/zero_variance_rate",
            "zve/zero_variance_rate_expanded",
            "zve/zero_variance_rate_reshaped",
            "zve/zero_variance_rate_final",
        ),
    ),
    ("entropy", ("actor/entropy",)),
    ("clip fractions", ("actor/clip_fraction", "espo/clip_fraction")),
    ("train / rollout mismatch", ("mismatch/logp_abs_diff", "mismatch/routing_agreement")),
    ("time per phase (s)", ("time/rollout_s", "time/train_s", "time/step_s")),
    ("SFT loss", ("sft/loss",)),
)


def pass_key(runs: list[RunRecord]) -> str | None:
    """The pass@k the runs' evaluations report (the first k found)."""
    for run in runs:
        for key in run.final:
            if key.startswith("pass@") and "/" not in key:
                return key
    return None


def run_value(run: RunRecord, column: Column, pass_name: str | None) -> float:
    """One run's figure for a column (NaN when it has none)."""
    if column.how in (FINAL, INITIAL):
        key = pass_name if column.key == "pass@k" else column.key
        held_out = run.final if column.how == FINAL else run.initial
        return held_out.get(key, float("nan")) if key else float("nan")
    values = finite(run.series(column.key)[1])
    return REDUCTIONS[column.how](values) if values else float("nan")


@dataclass
class Entry:
    """One arm's figure in one column."""

    spread: Spread
    difference: Difference | None = None  # to the first arm, for compared columns of the other arms


def summary(arms: list[Arm]) -> tuple[list[Column], list[list[Entry]]]:
    """The columns any run has a figure for, and per arm an Entry for each."""
    runs = [run for arm in arms for run in arm.runs]
    pass_name = pass_key(runs)
    columns = [
        column for column in COLUMNS if any(math.isfinite(run_value(run, column, pass_name)) for run in runs)
    ]
    columns = [replace(c, label=pass_name) if c.key == "pass@k" and pass_name else c for c in columns]
    table = [
        [Entry(Spread.of(run_value(r, c, pass_name) for r in arm.runs)) for c in columns] for arm in arms
    ]
    for row in table[1:]:
        for index, column in enumerate(columns):
            if column.compare:
                row[index].difference = bootstrap_difference(row[index].spread, table[0][index].spread)
    return columns, table


def levels(arms: list[Arm]) -> tuple[list[str], list[list[Spread]]]:
    """Held-out greedy accuracy per difficulty level (the `greedy_accuracy/<level>` keys), per arm."""
    names = sorted(
        {
            k.split("/", 1)[1]
            for arm in arms
            for run in arm.runs
            for k in run.final
            if k.startswith("greedy_accuracy/")
        }
    )
    return names, [
        [
            Spread.of(run.final.get(f"greedy_accuracy/{name}", float("nan")) for run in arm.runs)
            for name in names
        ]
        for arm in arms
    ]


def fmt(value: float, percent: bool = False, signed: bool = False) -> str:
    if value is None or not math.isfinite(value):
        return "–"
    if percent:
        return f"{value * 100:+.1f} pt" if signed else f"{value:.1%}"
    sign = "+" if signed else ""
    return f"{value:{sign},.0f}" if abs(value) >= 100 else f"{value:{sign}.3g}"


def describe(entry: Entry, percent: bool) -> str:
    """'mean ± sd' of an entry, and how many runs had no finite value ('(k without)')."""
    spread = entry.spread
    if not spread.n:
        return "–"
    text = fmt(spread.mean, percent)
    if spread.n > 1:
        text += f" ± {spread.sd:.1%}" if percent else f" ± {spread.sd:.2g}"
    if spread.left_out:
        text += f" ({spread.left_out} without)"
    return text


def describe_difference(difference: Difference | None, percent: bool) -> str:
    if difference is None or not math.isfinite(difference.value):
        return ""
    text = fmt(difference.value, percent, signed=True)
    if difference.low is None:
        return text + " (CI needs ≥ 2 seeds an arm)"
    low, high = (fmt(v, percent, True).removesuffix(" pt") for v in (difference.low, difference.high))
    return f"{text} [{low}, {high}]"


def _smooth(steps: list[int], values: list[float]) -> tuple[list[int], list[float]]:
    """Noisy per-step series (more than 20 points): the moving mean over a tenth of the run."""
    if len(values) <= 20:
        return steps, values
    window = max(2, len(values) // 10)
    return steps[window - 1 :], moving_average(values, window)


def arm_curve(arm: Arm, key: str) -> tuple[list[int], list[float], list[float], list[float]] | None:
    """(steps, mean, low, high) over the arm's seeds of each seed's (smoothed) finite values."""
    by_step: dict[int, list[float]] = {}
    for run in arm.runs:
        steps, values = run.series(key)
        pairs = [(s, v) for s, v in zip(steps, values) if math.isfinite(v)]
        if not pairs:
            continue
        steps, values = _smooth([s for s, _ in pairs], [v for _, v in pairs])
        for step, value in zip(steps, values):
            by_step.setdefault(step, []).append(value)
    if not by_step:
        return None
    steps = sorted(by_step)
    return (
        steps,
        [finite_mean(by_step[s]) for s in steps],
        [min(by_step[s]) for s in steps],
        [max(by_step[s]) for s in steps],
    )


def png_of(figure, dpi: int = 110) -> bytes:
    """A matplotlib figure laid out, drawn to PNG bytes, and closed."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    plt.close(figure)
    return buffer.getvalue()


def _seeds_series(arms: list[Arm], key: str) -> list:
    """Every run's series of `key` (equal for two keys only when each run logged the same values)."""
    return [run.series(key) for arm in arms for run in arm.runs]


def figures(arms: list[Arm]) -> list[tuple[str, bytes]]:
    """(title, PNG) of every FIGURES entry some run logged: one panel per key, one line per arm with its
    seeds' range shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = []
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for title, keys in FIGURES:
        curves = {key: [(arm, arm_curve(arm, key)) for arm in arms] for key in keys}
        curves = {key: found for key, found in curves.items() if any(c for _, c in found)}
        curves = {key: curves[key] for key in distinct(list(curves), lambda key: _seeds_series(arms, key))}
        if not curves:
            continue
        figure, axes = plt.subplots(1, len(curves), figsize=(4.6 * len(curves), 3.2), squeeze=False)
        for axis, (key, found) in zip(axes.flat, curves.items()):
            for index, (arm, curve) in enumerate(found):
                if curve is None:
                    continue
                steps, mean, low, high = curve
                colour = colours[index % len(colours)]
                marker = "o" if len(steps) <= 20 else None
                axis.plot(
                    steps, mean, color=colour, linewidth=1.5, marker=marker, markersize=3, label=arm.name
                )
                if len(arm.runs) > 1:
                    axis.fill_between(steps, low, high, color=colour, alpha=0.18, linewidth=0)
            axis.set_title(key, fontsize=9)
            axis.set_xlabel("step", fontsize=8)
            axis.tick_params(labelsize=8)
            axis.grid(alpha=0.3)
        axes.flat[0].legend(fontsize=7)
        drawn.append((title, png_of(figure, dpi=100)))
    return drawn
