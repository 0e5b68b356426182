"""The runs a cross-run report compares, read from their directories, and the arms they form.

A path is a run directory (it holds `config.yaml`) or a sweep directory (`sweep.json`: its cells, in the
sweep's order). Runs whose configs differ only in `seed` form one arm; the arm's name is the config keys
that set it apart. Whatever a run lacks (it failed, never evaluated, logged NaN) is left blank, never
guessed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from everyprompt.report.summary import Metrics, ReportError, load_metrics, read_config
from everyprompt.run.layout import RunLayout, SweepLayout

SEED_KEY = "seed"
# keys that name where a run lives rather than what it did
IGNORED_KEYS = ("run_dir", "name")
# metrics counted as errors of a run: summed over its steps when any is non-zero
ERROR_KEYS = (
    "reward/errors",
    "actor/skipped_updates",
    "cluster/actor_restarts",
    "reward/genrm_unparseable",
)


def flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    """A nested config -> {dotted key: its value as YAML would write it}."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return flat


@dataclass
class RunRecord:
    """One run as the report sees it."""

    name: str
    path: Path
    config: dict[str, str]
    rl: Metrics | None
    sft: Metrics | None
    final: dict[str, float]  # the held-out evaluation after the last step ({} when there is none)
    initial: dict[str, float] = field(default_factory=dict)  # before the first RL step, where it was made
    state: str = "done"  # done | incomplete | failed | stopped (a sweep's status) ...
    warnings: list[str] = field(default_factory=list)
    errors: dict[str, float] = field(default_factory=dict)
    label: str | None = None  # the arm's name in the sweep that made it, when the sweep named its arms

    @property
    def seed(self) -> str:
        return self.config.get(SEED_KEY, "?")

    def series(self, key: str) -> tuple[list[int], list[float]]:
        source = self.sft if key.startswith("sft/") else self.rl
        return source.series(key) if source is not None else ([], [])


def _final_eval(run_dir: Path, rl: Metrics | None) -> dict[str, float]:
    """eval.json (train), else a demo's summary.json, else the last `eval/*` the metrics logged."""
    layout = RunLayout(run_dir)
    for path, part in ((layout.eval_results, None), (layout.demo_summary, "eval_after_rl")):
        if path.is_file():
            try:
                loaded = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as err:
                raise ReportError(f"{path}: not valid JSON ({err.msg})") from None
            loaded = loaded.get(part, {}) if part else loaded
            return {k: float(v) for k, v in loaded.items() if isinstance(v, (int, float))}
    if rl is not None:
        for record in reversed(rl.records):
            if "eval/greedy_accuracy" in record:
                return {k.removeprefix("eval/"): v for k, v in record.items() if k.startswith("eval/")}
    return {}


def _initial_eval(run_dir: Path) -> dict[str, float]:
    """The held-out evaluation before RL: a demo's summary.json has it ({} for a run without one)."""
    path = RunLayout(run_dir).demo_summary
    if not path.is_file():
        return {}
    try:
        loaded = json.loads(path.read_text(encoding="utf-8")).get("eval_before_rl", {})
    except json.JSONDecodeError as err:
        raise ReportError(f"{path}: not valid JSON ({err.msg})") from None
    return {k: float(v) for k, v in loaded.items() if isinstance(v, (int, float))}


def _warnings(run_dir: Path) -> list[str]:
    path = RunLayout(run_dir).warnings
    if not path.is_file():
        return []
    return [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]


def _errors(rl: Metrics | None) -> dict[str, float]:
    counted: dict[str, float] = {}
    for key in ERROR_KEYS:
        values = rl.series(key)[1] if rl is not None else []
        total = sum(v for v in values if math.isfinite(v))
        if total:
            counted[key] = total
    if rl is not None:
        non_finite = sum(1 for r in rl.records for k, v in r.items() if not math.isfinite(v) and k != "step")
        if non_finite:
            counted["non-finite metric values"] = float(non_finite)
    return counted


def load_run(run_dir: Path, name: str | None = None, state: str | None = None) -> RunRecord:
    """Read a run directory; a run that has not logged a step yet is still a run (with no curves)."""
    layout = RunLayout(run_dir)
    if not layout.started():
        raise ReportError(
            f"{run_dir}: no {layout.config.name}; not a run directory (or a sweep's "
            f"{SweepLayout(run_dir).plan.name})"
        )
    rl_path, sft_path = layout.metrics, layout.sft.metrics
    rl = load_metrics(rl_path) if rl_path.is_file() else None
    sft = load_metrics(sft_path) if sft_path.is_file() else None
    final = _final_eval(run_dir, rl)
    return RunRecord(
        name=name or run_dir.name,
        path=run_dir,
        config=flatten(read_config(run_dir)),
        rl=rl,
        sft=sft,
        final=final,
        initial=_initial_eval(run_dir),
        state=state or ("done" if final else "incomplete"),
        warnings=_warnings(run_dir),
        errors=_errors(rl),
    )


def load_runs(paths: list[str | Path]) -> list[RunRecord]:
    """The runs under the given run and sweep directories, in the order given (a sweep's in its order)."""
    runs: list[RunRecord] = []
    for given in paths:
        path = Path(given)
        if not path.is_dir():
            raise ReportError(f"{path}: no such run or sweep directory")
        if SweepLayout(path).is_sweep():
            runs.extend(_sweep_runs(path))
        else:
            runs.append(load_run(path))
    if not runs:
        raise ReportError(f"{', '.join(map(str, paths))}: no run has started there yet")
    names = [r.name for r in runs]
    for run in runs:  # two sweeps may hold cells of the same name
        if names.count(run.name) > 1:
            run.name = f"{run.path.parent.name}/{run.name}"
    return runs


def _sweep_runs(sweep_dir: Path) -> list[RunRecord]:
    sweep = SweepLayout(sweep_dir)
    try:
        plan = json.loads(sweep.plan.read_text(encoding="utf-8"))
        cells = [(cell["name"], cell.get("arm")) for cell in plan["cells"]]
    except (ValueError, KeyError, TypeError) as err:
        raise ReportError(f"{sweep.plan}: not a sweep plan ({err})") from None
    status_path = sweep.status  # written atomically by the sweep; absent before a cell ended
    try:
        status = json.loads(status_path.read_text(encoding="utf-8")) if status_path.is_file() else {}
    except ValueError as err:
        raise ReportError(f"{status_path}: not valid JSON ({err})") from None
    runs = []
    for name, arm in cells:
        cell_dir = sweep.cell(name).root
        if not sweep.cell(name).started():
            continue  # never started
        state = (status.get(name) or {}).get("state")
        runs.append(load_run(cell_dir, name, None if state in (None, "skipped") else state))
        if arm is not None:  # the cell's name without its seed: the arm and the grid's values
            runs[-1].label = name.rpartition(",seed=")[0]
        if runs[-1].state == "failed":
            error = (status.get(name) or {}).get("error")
            if error:
                runs[-1].warnings.append(f"the cell failed: {error}")
    return runs


def differing_keys(runs: list[RunRecord]) -> list[str]:
    """Config keys whose value is not the same in every run (absent counts as a value), sorted."""
    keys = sorted({k for run in runs for k in run.config} - set(IGNORED_KEYS))
    return [k for k in keys if len({run.config.get(k, "<absent>") for run in runs}) > 1]


@dataclass
class Arm:
    """Runs whose configs differ only by seed."""

    name: str
    setting: dict[str, str]  # the differing keys (seed aside) and this arm's values
    runs: list[RunRecord]


def arms_of(runs: list[RunRecord]) -> list[Arm]:
    """Group runs into arms, in the order each arm first appears; the first arm is the reference."""
    keys = [k for k in differing_keys(runs) if k != SEED_KEY]
    arms: dict[tuple, Arm] = {}
    for run in runs:
        setting = {k: run.config.get(k, "<absent>") for k in keys}
        identity = tuple(setting.items())
        if identity not in arms:
            name = ", ".join(f"{k.rpartition('.')[2]}={v}" for k, v in setting.items()) or "all runs"
            arms[identity] = Arm(name, setting, [])
        arms[identity].runs.append(run)
    names = [arm.name for arm in arms.values()]
    for arm in arms.values():  # short names can clash (two keys ending alike): use the full keys then
        if names.count(arm.name) > 1:
            arm.name = ", ".join(f"{k}={v}" for k, v in arm.setting.items())
    labels = [{run.label for run in arm.runs} for arm in arms.values()]
    if all(len(found) == 1 and None not in found for found in labels):  # the arms a sweep named
        for arm, (label,) in zip(arms.values(), labels):
            arm.name = label
    return list(arms.values())
