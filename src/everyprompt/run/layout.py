"""Every file and folder name of a run directory (and of a sweep and an offline-filter directory), and the
functions that find them. No other module spells these names: they import them from here.

    RUN/
      config.yaml           the resolved config (saved when the run starts)
      metrics.jsonl         RL: one JSON object per step
      tensorboard/          RL curves
      warnings.log          everyprompt's warnings during the run
      passrates.sqlite      the pass-rate store (ZVE, curriculum retirement)
      filter.json           the offline filter's result (ZVE stage 0)
      eval.json             held-out evaluation after the last step (`train`; written last)
      completions.jsonl     `everyprompt eval`: its greedy completions (prompt, completion, answer, reward)
      summary.json          `demo`: accuracy before and after RL
      genrm_samples.jsonl   judged rows of a generative reward model
      rollouts.jsonl        a driven run's acknowledged groups, one line a request (docs/serving.md)
      sft/                  the SFT phase's metrics.jsonl and tensorboard/
      checkpoints/
        sft                 the finished SFT model
        sft_step_N          a cut-short SFT stage's resumable state
        step_N              RL checkpoints
        latest -> step_N
      report/               `everyprompt report`: summary.json, summary.md, rl_curves.png, report.html
      output.log            a sweep cell's console output

    SWEEP/  sweep.json (the plan), base.yaml (its base config), status.json (cell states), one RUN per cell
    FILTER/ kept.jsonl, report.json, pass_rates.png, passrates.sqlite (`everyprompt filter --out FILTER`)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
WARNINGS = "warnings.log"
PASS_RATES = "passrates.sqlite"
FILTER_RESULT = "filter.json"
EVAL = "eval.json"
EVAL_COMPLETIONS = "completions.jsonl"  # `everyprompt eval`: the greedy completions, beside eval.json
DEMO_SUMMARY = "summary.json"
GENRM_SAMPLES = "genrm_samples.jsonl"
ROLLOUTS_JOURNAL = "rollouts.jsonl"  # a driven run's acknowledged groups (serve/intake.py)
SFT = "sft"  # the SFT phase's log folder, and the name of its finished checkpoint
CHECKPOINTS = "checkpoints"
LATEST = "latest"
RL_STEP = "step_"  # checkpoints/step_N
SFT_STEP = "sft_step_"  # checkpoints/sft_step_N
REPORT = "report"
REPORT_SUMMARY = "summary.json"
REPORT_MARKDOWN = "summary.md"
REPORT_CURVES = "{phase}_curves.png"  # rl_curves.png, sft_curves.png
REPORT_HTML = "report.html"
CELL_LOG = "output.log"
EVAL_DIR = "eval"  # `everyprompt eval CHECKPOINT` writes its eval.json in CHECKPOINT/eval/ by default

SWEEP_PLAN = "sweep.json"
SWEEP_BASE = "base.yaml"
SWEEP_STATUS = "status.json"

FILTER_KEPT = "kept.jsonl"
FILTER_REPORT = "report.json"
FILTER_HISTOGRAM = "pass_rates.png"


class _In:
    """A path under a layout's root: `config = _In(CONFIG)` makes `layout.config` be `root / CONFIG`."""

    def __init__(self, *parts: str):
        self.parts = parts

    def __get__(self, layout, owner=None):
        return self if layout is None else layout.root.joinpath(*self.parts)


@dataclass(frozen=True)
class _Folder:
    root: Path | str  # a Path once made

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))


@dataclass(frozen=True)
class RunLayout(_Folder):
    """The paths of one run directory (nothing is created here)."""

    config = _In(CONFIG)
    metrics = _In(METRICS)
    tensorboard = _In(TENSORBOARD)
    warnings = _In(WARNINGS)
    pass_rates = _In(PASS_RATES)
    filter_result = _In(FILTER_RESULT)
    eval_results = _In(EVAL)
    completions = _In(EVAL_COMPLETIONS)
    demo_summary = _In(DEMO_SUMMARY)
    genrm_samples = _In(GENRM_SAMPLES)
    rollouts_journal = _In(ROLLOUTS_JOURNAL)
    cell_log = _In(CELL_LOG)
    report = _In(REPORT)
    report_summary = _In(REPORT, REPORT_SUMMARY)
    report_markdown = _In(REPORT, REPORT_MARKDOWN)
    report_html = _In(REPORT, REPORT_HTML)
    checkpoints = _In(CHECKPOINTS)
    latest = _In(CHECKPOINTS, LATEST)
    sft_checkpoint = _In(CHECKPOINTS, SFT)

    @property
    def sft(self) -> RunLayout:
        """The SFT phase's own log folder (its metrics.jsonl and tensorboard/)."""
        return RunLayout(self.root / SFT)

    def report_curves(self, phase: str) -> Path:
        """The curves of phase `rl` or `sft`."""
        return self.report / REPORT_CURVES.format(phase=phase)

    def step_checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"{RL_STEP}{step}"

    def sft_step_checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"{SFT_STEP}{step}"

    def step_checkpoints(self) -> list[Path]:
        """RL's `step_N` checkpoints, oldest first (complete or not)."""
        return numbered(self.checkpoints, RL_STEP)

    def sft_step_checkpoints(self) -> list[Path]:
        """A cut-short SFT stage's `sft_step_N` checkpoints, oldest first."""
        return numbered(self.checkpoints, SFT_STEP)

    def started(self) -> bool:
        """A run has started here before (its config is saved first thing)."""
        return self.config.is_file()

    def holds_results(self) -> bool:
        """Anything a stage made is here: a checkpoint, an SFT or RL step's metrics, the offline filter's
        result, an evaluation (what a start writes before its first step, config.yaml, the warnings and the
        pass-rate store, is not)."""
        made = (self.sft.root, self.metrics, self.filter_result, self.eval_results, self.demo_summary)
        return any(path.exists() for path in made) or any(self.checkpoints.glob("*"))


def numbered(root: Path, prefix: str) -> list[Path]:
    """The `<prefix>N` entries under `root`, by N (oldest first)."""
    entries = [p for p in root.glob(f"{prefix}*") if p.name[len(prefix) :].isdigit()]
    return sorted(entries, key=lambda p: int(p.name[len(prefix) :]))


def series(checkpoint: Path) -> list[Path]:
    """The checkpoints of the same `<prefix>N` series as `checkpoint` (step_N or sft_step_N), oldest first."""
    prefix = SFT_STEP if checkpoint.name.startswith(SFT_STEP) else RL_STEP
    return numbered(checkpoint.parent, prefix)


def find_checkpoint(path: str | Path) -> Path | None:
    """The model checkpoint at `path`: the directory itself, a run directory's `checkpoints/latest`, or a
    `checkpoints/` folder's `latest` (a model directory holds a `config.json`); None if none is there."""
    path = Path(path)
    for candidate in (path, path / LATEST, path / CHECKPOINTS / LATEST):
        if (candidate / "config.json").is_file():
            return candidate.resolve()
    return None


def run_of(path: str | Path) -> RunLayout | None:
    """The run directory that `path` (a run directory, its `checkpoints/` or one of its checkpoints) belongs
    to, when it is one (its config is saved there); else None."""
    path = Path(path)
    for candidate in (path, path.parent, path.parent.parent):
        layout = RunLayout(candidate)
        inside = candidate == path or path.is_relative_to(layout.checkpoints)
        if inside and layout.started():
            return layout
    return None


def eval_dir(checkpoint: Path, hub_id: str | None = None) -> Path:
    """Where `everyprompt eval CHECKPOINT` writes by default: CHECKPOINT/eval/ for a directory, NAME-eval/
    beside a model file (a .gguf), ORG--NAME-eval/ in the working directory for a model named by its Hub
    id `hub_id` (never inside the Hugging Face cache)."""
    if hub_id is not None:
        return Path(hub_id.replace("/", "--").replace("@", "-") + f"-{EVAL_DIR}")
    if checkpoint.is_file():
        return checkpoint.parent / f"{checkpoint.stem}-{EVAL_DIR}"
    return checkpoint / EVAL_DIR


@dataclass(frozen=True)
class SweepLayout(_Folder):
    """A sweep directory: its plan, base config and status, and one run directory per cell."""

    plan = _In(SWEEP_PLAN)
    base_config = _In(SWEEP_BASE)
    status = _In(SWEEP_STATUS)
    report_html = _In(REPORT_HTML)

    def cell(self, name: str) -> RunLayout:
        return RunLayout(self.root / name)

    def is_sweep(self) -> bool:
        return self.plan.is_file()


@dataclass(frozen=True)
class FilterLayout(_Folder):
    """What `everyprompt filter --out DIR` writes."""

    kept = _In(FILTER_KEPT)
    report = _In(FILTER_REPORT)
    histogram = _In(FILTER_HISTOGRAM)
    pass_rates = _In(PASS_RATES)

    def names(self) -> str:
        return ", ".join((FILTER_KEPT, FILTER_REPORT, FILTER_HISTOGRAM, PASS_RATES))
