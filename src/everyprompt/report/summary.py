"""A run's report (`everyprompt report RUN_DIR`): what a run did, from the files it wrote.

Reads `metrics.jsonl` (RL; `sft/metrics.jsonl` for the warm start), `config.yaml` and, for a demo,
`summary.json`; writes `RUN_DIR/report/summary.json`, `summary.md` and `curves.png`. A resumed run
appends the steps after its last checkpoint again; each step's last record is the one that counts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from everyprompt.data.datasets import read_jsonl
from everyprompt.errors import InputError
from everyprompt.run.layout import RunLayout

# (panel title, metric keys drawn in it); a panel whose keys the run never logged is left out
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("SFT loss", ("sft/loss",)),
    ("training reward", ("reward/accuracy", "reward/mean")),
    ("held-out greedy accuracy", ("eval/greedy_accuracy",)),
    ("policy loss", ("loss/policy",)),
    ("entropy", ("actor/entropy",)),
    ("zero-variance groups", ("zve/zero_variance_rate", "zve/zero_variance_rate_final")),
    ("rollouts carrying signal", ("zve/signal_rollout_fraction",)),
    ("train / rollout mismatch |dlogp|", ("mismatch/logp_abs_diff",)),
    ("routing agreement", ("mismatch/routing_agreement",)),
    ("rollout tokens/s", ("rollout/tokens_per_s",)),
    ("seconds per step", ("time/step_s", "time/rollout_s", "time/train_s")),
    ("learner's peak memory (GiB)", ("memory/peak_rss_gib", "memory/cuda_peak_gib")),
)

# summary rows: (label, key, how): "ends" compares the first and last tenth of the steps, "evals" the first
# and last logged value; any other `how` is one figure, a REDUCTIONS entry ("any": a 0/1 flag, shown yes/no)
ROWS: tuple[tuple[str, str, str], ...] = (
    ("SFT loss", "sft/loss", "ends"),
    ("training accuracy", "reward/accuracy", "ends"),
    ("held-out greedy accuracy", "eval/greedy_accuracy", "evals"),
    ("held-out pass@k", "eval/pass@k", "evals"),
    ("policy entropy", "actor/entropy", "ends"),
    ("reverse KL to the teacher (rl.teacher)", "distill/reverse_kl", "ends"),
    ("zero-variance rate (sampled)", "zve/zero_variance_rate", "mean"),
    ("zero-variance rate (trained on)", "zve/zero_variance_rate_final", "mean"),
    ("rollouts carrying signal", "zve/signal_rollout_fraction", "mean"),
    ("routing agreement", "mismatch/routing_agreement", "mean"),
    ("|dlogp| trainer vs engine", "mismatch/logp_abs_diff", "mean"),
    ("rollout tokens/s", "rollout/tokens_per_s", "median"),
    ("decode step (ms)", "rollout/decode_step_ms", "median"),
    # the native engine's CUDA graphs, where it decodes with them: a refused capture is a row, not a log line
    ("CUDA graph capture refused", "rollout/graph_failed", "any"),
    ("decode steps without their CUDA graph", "rollout/graph_eager_steps", "sum"),
    # a compiled path given up (rollout.compile, model.kernels=compiled): it warned once; the row stays
    ("compiled decode step given up", "rollout/compile_failed", "any"),
    ("learner's layers running compiled (fewest)", "actor/compiled_layers", "min"),
    ("seconds per step", "time/step_s", "median"),
    ("learner's peak resident memory (GiB)", "memory/peak_rss_gib", "max"),
    ("learner's peak CUDA memory (GiB)", "memory/cuda_peak_gib", "max"),
    ("policy loss", "loss/policy", "mean"),
    ("skipped updates (non-finite)", "actor/skipped_updates", "sum"),
    ("steps without signal (no update)", "actor/no_signal_update", "sum"),
    ("reward errors", "reward/errors", "sum"),
)


class ReportError(InputError):
    """The run directory cannot be reported on; the message names the file and why (a malformed line is
    data.read_jsonl's DataError, naming the line)."""


@dataclass
class Metrics:
    """One metrics file: each step's last record, in step order."""

    path: Path
    records: list[dict[str, float]]

    @property
    def steps(self) -> list[int]:
        return [int(r["step"]) for r in self.records]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the records that logged `key`."""
        pairs = [(int(r["step"]), float(r[key])) for r in self.records if key in r]
        return [s for s, _ in pairs], [v for _, v in pairs]


def load_metrics(path: str | Path) -> Metrics:
    """Read a metrics.jsonl (`data.read_jsonl`: a malformed line is a DataError naming file and line)."""
    by_step: dict[int, dict[str, float]] = {}
    for record in read_jsonl(path, required=("step",)):
        step = record["step"]
        if isinstance(step, bool) or not isinstance(step, int):
            raise ReportError(f"{path}: expected integer steps, got step {step!r}")
        numbers = {
            k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        by_step[step] = numbers  # a resumed run logs its steps after the last checkpoint again
    return Metrics(Path(path), [by_step[s] for s in sorted(by_step)])


def finite_mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def _median(values: list[float]) -> float:
    finite = sorted(v for v in values if math.isfinite(v))
    if not finite:
        return float("nan")
    middle = len(finite) // 2
    return finite[middle] if len(finite) % 2 else (finite[middle - 1] + finite[middle]) / 2


def _max(values: list[float]) -> float:
    return max((v for v in values if math.isfinite(v)), default=float("nan"))


def _min(values: list[float]) -> float:
    return min((v for v in values if math.isfinite(v)), default=float("nan"))


def _sum(values: list[float]) -> float:
    return sum(v for v in values if math.isfinite(v))


def _last_tenth(values: list[float]) -> float:
    return finite_mean(values[-max(1, len(values) // 10) :])


# how one figure is made from a run's per-step values (non-finite values are skipped): the summary rows
# and the comparison table's columns name one of these
REDUCTIONS: dict[str, Callable[[list[float]], float]] = {
    "mean": finite_mean,
    "median": _median,
    "max": _max,
    "min": _min,
    "any": _max,  # a 0/1 flag: whether any step raised it (shown yes / no)
    "sum": _sum,
    "last tenth": _last_tenth,
}


def summarize(metrics: Metrics, pass_k: int | None = None) -> list[dict]:
    """One row per ROWS entry the run logged: {'label', 'key', 'how', ...figures}."""
    rows = []
    for label, key, how in ROWS:
        if key == "eval/pass@k":
            if pass_k is None:
                continue
            key, label = f"eval/pass@{pass_k}", f"held-out pass@{pass_k}"
        steps, values = metrics.series(key)
        if not values:
            continue
        row: dict = {"label": label, "key": key, "how": how}
        if how == "ends":
            tenth = max(1, len(values) // 10)
            row["first"], row["last"] = finite_mean(values[:tenth]), finite_mean(values[-tenth:])
            row["steps_each"] = tenth
        elif how == "evals":
            row["first"], row["last"] = values[0], values[-1]
            row["first_step"], row["last_step"] = steps[0], steps[-1]
        else:
            row["value"] = REDUCTIONS[how](values)
        row["non_finite"] = sum(not math.isfinite(v) for v in values)
        rows.append(row)
    return rows


def format_row(row: dict) -> str:
    """A summary row's figures as text."""

    def fmt(value: float) -> str:
        if not math.isfinite(value):
            return "nan"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.4g}" if abs(value) < 1e-2 and value != 0 else f"{value:.3f}"

    if row["how"] == "ends":
        return f"{fmt(row['first'])} -> {fmt(row['last'])} (first / last {row['steps_each']} steps)"
    if row["how"] == "evals":
        return (
            f"{fmt(row['first'])} (step {row['first_step']}) -> {fmt(row['last'])} (step {row['last_step']})"
        )
    if row["how"] == "any" and math.isfinite(row["value"]):
        return "yes (in some step)" if row["value"] >= 1 else "no"
    if row["how"] == "sum" and float(row["value"]).is_integer():
        return f"{int(row['value'])} (sum)"
    return f"{fmt(row['value'])} ({row['how']})"


def moving_average(values: list[float], window: int) -> list[float]:
    """Mean of each `window` consecutive values (NaN ones skipped), one per full window."""
    return [finite_mean(values[i - window : i]) for i in range(window, len(values) + 1)]


def distinct(keys: list[str], series: Callable[[str], object]) -> list[str]:
    """`keys` without those whose series equals an earlier key's (`reward/mean` and `reward/accuracy` under
    a reward of 0 or 1: one curve, not two drawn on top of each other)."""
    kept: list[str] = []
    for key in keys:
        if not any(series(key) == series(other) for other in kept):
            kept.append(key)
    return kept


def plot(metrics: Metrics, path: Path, title: str) -> list[str]:
    """Draw PANELS (those the run logged) into one PNG; returns the panel titles drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (name, distinct([k for k in keys if metrics.series(k)[1]], metrics.series)) for name, keys in PANELS
    ]
    panels = [(name, keys) for name, keys in panels if keys]
    if not panels:
        return []
    columns = 3
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 2.8 * rows), squeeze=False)
    for axis, (name, keys) in zip(axes.flat, panels):
        for key in keys:
            steps, values = metrics.series(key)
            if len(values) <= 20:
                axis.plot(steps, values, marker="o", markersize=3, linewidth=1.2, label=key)
                continue
            # noisy per-step values thin, their moving average over a tenth of the run on top
            window = max(2, len(values) // 10)
            (line,) = axis.plot(steps, values, linewidth=0.8, alpha=0.35)
            axis.plot(
                steps[window - 1 :],
                moving_average(values, window),
                color=line.get_color(),
                linewidth=1.6,
                label=f"{key} (mean of {window})",
            )
        axis.set_title(name, fontsize=10)
        axis.set_xlabel("step", fontsize=8)
        axis.tick_params(labelsize=8)
        axis.legend(fontsize=7)
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(panels) :]:
        axis.axis("off")
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return [name for name, _ in panels]


def read_config(run_dir: Path) -> dict:
    path = RunLayout(run_dir).config
    if not path.is_file():
        return {}
    import yaml

    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ReportError(f"{path}: not valid YAML ({err})") from None
    return loaded if isinstance(loaded, dict) else {}


def report(run_dir: str | Path) -> dict:
    """Summarise and plot a run directory into RUN_DIR/report/; returns what summary.json holds."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such run directory")
    layout = RunLayout(run_dir)
    rl_path, sft_path = layout.metrics, layout.sft.metrics
    if not rl_path.is_file() and not sft_path.is_file():
        raise ReportError(
            f"{run_dir}: no {rl_path.name} (not a run directory, or the run has not finished a step yet)"
        )
    config = read_config(run_dir)
    pass_k = (config.get("eval") or {}).get("pass_k")
    layout.report.mkdir(exist_ok=True)
    summary: dict = {"run_dir": str(run_dir.resolve())}
    for name, path in (("rl", rl_path), ("sft", sft_path)):
        if not path.is_file():
            continue
        metrics = load_metrics(path)
        if not metrics.records:
            summary[name] = {"steps": 0, "rows": [], "curves": None}
            continue
        curves = layout.report_curves(name)
        drawn = plot(metrics, curves, f"{run_dir.name}: {name.upper()} ({len(metrics.records)} steps)")
        summary[name] = {
            "steps": len(metrics.records),
            "last_step": metrics.steps[-1],
            "rows": summarize(metrics, pass_k),
            "curves": curves.name if drawn else None,
            "panels": drawn,
        }
    demo = layout.demo_summary
    if demo.is_file():
        try:
            summary["demo"] = json.loads(demo.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ReportError(f"{demo}: not valid JSON ({err.msg})") from None
    summary["config"] = {
        key: value
        for key, value in (
            ("model", (config.get("model") or {}).get("path") or "built-in tiny MoE"),
            ("loss", (config.get("rl") or {}).get("loss")),
            ("advantage", (config.get("rl") or {}).get("advantage")),
            ("zve", (config.get("zve") or {}).get("enabled")),
            ("rollout precision", (config.get("rollout") or {}).get("precision")),
            ("router replay", (config.get("rl") or {}).get("router_replay")),
        )
        if value is not None
    }
    layout.report_summary.write_text(json.dumps(summary, indent=2), encoding="utf-8")
    layout.report_markdown.write_text(markdown(summary), encoding="utf-8")
    return summary


def markdown(summary: dict) -> str:
    lines = [f"# Run report: {summary['run_dir']}", ""]
    if summary.get("config"):
        lines += [", ".join(f"{k}: {v}" for k, v in summary["config"].items()), ""]
    demo = summary.get("demo")
    if demo:
        lines += [
            f"Demo: held-out greedy accuracy {demo['accuracy_before_rl']:.1%} before RL -> "
            f"{demo['accuracy_after_rl']:.1%} after {demo['rl_steps']} RL steps "
            f"({demo['wall_seconds']:.0f} s).",
            "",
        ]
    for name in ("rl", "sft"):
        part = summary.get(name)
        if part is None:
            continue
        lines += [f"## {name.upper()}: {part['steps']} steps", ""]
        if part["rows"]:
            lines += ["| metric | value |", "| --- | --- |"]
            lines += [
                f"| {row['label']} | {format_row(row)}"
                + (f"; {row['non_finite']} non-finite values" if row["non_finite"] else "")
                + " |"
                for row in part["rows"]
            ]
            lines.append("")
        if part.get("curves"):
            lines += [f"![{name} curves]({part['curves']})", ""]
    return "\n".join(lines)
