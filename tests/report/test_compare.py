"""The cross-run report: its statistics by hand on hand-made runs, arms and differing keys, runs with NaN or
missing metrics, the self-contained HTML page, and the page in a real browser (headless Chromium)."""

from __future__ import annotations

import base64
import json
import math
import re

import pytest

from everyprompt.cli import main
from everyprompt.report import ReportError
from everyprompt.report.compare import (
    COLUMNS,
    FIGURES,
    describe,
    describe_difference,
    levels,
    run_value,
    summary,
)
from everyprompt.report.html import render
from everyprompt.report.runs import arms_of, differing_keys, load_runs
from everyprompt.report.stats import Spread, bootstrap_difference
from tests.report.browser import laid_out, needs_chromium, screenshot

NAN = float("nan")


def _run(root, name, loss, seed, final=None, steps=10, accuracy=lambda s: s / 10, extra=None):
    """A run directory as `everyprompt train` leaves it: config.yaml, metrics.jsonl, eval.json."""
    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(
        f"seed: {seed}\nname: demo\nrun_dir: null\nrl:\n  loss: {loss}\n  steps: {steps}\n"
    )
    records = []
    for step in range(1, steps + 1):
        record = {
            "step": step,
            "reward/accuracy": accuracy(step),
            "reward/mean": accuracy(step),
            "zve/zero_variance_rate": 0.5,
            "time/step_s": float(step),
            "actor/entropy": 1.0,
            "memory/peak_rss_gib": 2.0 + min(step, 5) / 10,
        }
        record.update((extra or {}).get(step, {}))
        records.append(record)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if final is not None:
        (run / "eval.json").write_text(json.dumps({"step": steps, **final}))
    return run


def _final(greedy, pass4, level_4=None):
    result = {"greedy_accuracy": greedy, "pass@4": pass4, "num_prompts": 100}
    if level_4 is not None:
        result["greedy_accuracy/level_4"] = level_4
    return result


# ------------------------------------------------------------------ statistics by hand
def test_mean_and_sample_sd_leave_out_what_is_not_finite():
    spread = Spread.of([0.5, 0.7, NAN, math.inf, None])
    assert spread.values == (0.5, 0.7) and spread.left_out == 3
    assert spread.mean == pytest.approx(0.6)
    assert spread.sd == pytest.approx(math.sqrt(((0.5 - 0.6) ** 2 + (0.7 - 0.6) ** 2) / 1))
    assert math.isnan(Spread.of([0.3]).sd) and math.isnan(Spread.of([]).mean)


def test_the_bootstrap_interval_by_hand():
    # arm {0.8, 0.9} vs reference {0.5, 0.7}: resampled means take 0.8 / 0.85 / 0.9 and 0.5 / 0.6 / 0.7
    # with chances 1/4, 1/2, 1/4; the extreme differences 0.1 and 0.4 each have chance 1/16 > 2.5%, so the
    # 95% percentile interval is exactly [0.1, 0.4]; the difference itself is 0.85 - 0.6
    difference = bootstrap_difference(Spread.of([0.8, 0.9]), Spread.of([0.5, 0.7]))
    assert difference.value == pytest.approx(0.25)
    assert (difference.low, difference.high) == (pytest.approx(0.1), pytest.approx(0.4))
    # seeds that agree: no spread at all
    same = bootstrap_difference(Spread.of([1.0, 1.0]), Spread.of([0.0, 0.0]))
    assert (same.value, same.low, same.high) == (1.0, 1.0, 1.0)
    # one seed a side: a difference, no interval
    single = bootstrap_difference(Spread.of([0.9]), Spread.of([0.5, 0.7]))
    assert single.value == pytest.approx(0.3) and single.low is None
    assert "needs" in describe_difference(single, percent=True)
    # the same draws every time
    assert bootstrap_difference(Spread.of([0.1, 0.5, 0.2]), Spread.of([0.3, 0.0])) == bootstrap_difference(
        Spread.of([0.1, 0.5, 0.2]), Spread.of([0.3, 0.0])
    )


def test_each_columns_figure_of_a_run_by_hand(tmp_path):
    _run(tmp_path, "a", "ppo_clip", 0, _final(0.5, 0.75), steps=20)
    (run,) = load_runs([tmp_path / "a"])
    by_key = {c.key: c for c in COLUMNS}
    assert run_value(run, by_key["greedy_accuracy"], "pass@4") == 0.5
    assert run_value(run, by_key["pass@k"], "pass@4") == 0.75
    # last tenth of 20 steps: steps 19 and 20, accuracy 1.9 and 2.0
    assert run_value(run, by_key["reward/accuracy"], "pass@4") == pytest.approx(1.95)
    assert run_value(run, by_key["zve/zero_variance_rate"], "pass@4") == 0.5  # mean
    assert run_value(run, by_key["time/step_s"], "pass@4") == 10.5  # median of 1..20
    assert run_value(run, by_key["memory/peak_rss_gib"], "pass@4") == 2.5  # the largest, from step 5 on


# ------------------------------------------------------------------ arms, keys, the table
def _two_arms(root):
    for seed, (greedy, pass4) in enumerate([(0.5, 0.6), (0.7, 0.8)]):
        _run(root, f"loss=ppo_clip,seed={seed}", "ppo_clip", seed, _final(greedy, pass4, level_4=greedy / 2))
    for seed, (greedy, pass4) in enumerate([(0.8, 0.9), (0.9, 1.0)]):
        _run(root, f"loss=espo,seed={seed}", "espo", seed, _final(greedy, pass4, level_4=greedy / 2))
    return [
        root / n
        for n in ("loss=ppo_clip,seed=0", "loss=ppo_clip,seed=1", "loss=espo,seed=0", "loss=espo,seed=1")
    ]


def test_arms_are_runs_that_differ_only_by_seed(tmp_path):
    runs = load_runs(_two_arms(tmp_path))
    assert differing_keys(runs) == ["rl.loss", "seed"]
    arms = arms_of(runs)
    assert [a.name for a in arms] == ["loss=ppo_clip", "loss=espo"]
    assert [len(a.runs) for a in arms] == [2, 2]


def test_the_summary_table_by_hand(tmp_path):
    arms = arms_of(load_runs(_two_arms(tmp_path)))
    columns, table = summary(arms)
    labels = [c.label for c in columns]
    assert labels[:2] == ["held-out greedy", "pass@4"]
    greedy_ref, greedy_espo = table[0][0], table[1][0]
    assert greedy_ref.spread.mean == pytest.approx(0.6) and greedy_espo.spread.mean == pytest.approx(0.85)
    assert greedy_ref.difference is None  # the reference arm
    assert (greedy_espo.difference.low, greedy_espo.difference.high) == (
        pytest.approx(0.1),
        pytest.approx(0.4),
    )
    assert describe(greedy_espo, percent=True) == "85.0% ± 7.1%"
    assert describe_difference(greedy_espo.difference, True) == "+25.0 pt [+10.0, +40.0]"
    pass_espo = table[1][1]
    assert pass_espo.difference.value == pytest.approx(0.25)
    names, per_level = levels(arms)
    assert names == ["level_4"] and per_level[1][0].mean == pytest.approx(0.425)


def test_runs_with_nan_or_missing_metrics_still_report(tmp_path):
    paths = _two_arms(tmp_path)
    # a run whose loss went NaN and that never evaluated, and a run that failed before logging anything
    _run(
        tmp_path, "loss=gspo,seed=0", "gspo", 0, None, extra={3: {"reward/accuracy": NAN, "loss/policy": NAN}}
    )
    empty = tmp_path / "loss=gspo,seed=1"
    empty.mkdir()
    (empty / "config.yaml").write_text("seed: 1\nname: demo\nrun_dir: null\nrl:\n  loss: gspo\n  steps: 10\n")
    runs = load_runs([*paths, tmp_path / "loss=gspo,seed=0", empty])
    arms = arms_of(runs)
    assert [a.name for a in arms][-1] == "loss=gspo"
    columns, table = summary(arms)
    gspo_greedy = table[2][0]
    assert gspo_greedy.spread.n == 0 and gspo_greedy.spread.left_out == 2
    assert describe(gspo_greedy, True) == "–"
    assert runs[4].errors == {"non-finite metric values": 2.0} and runs[4].state == "incomplete"
    assert runs[5].rl is None
    page = render(runs, arms, "t")
    assert "non-finite metric values: 2" in page and "loss=gspo" in page
    with pytest.raises(ReportError, match="not a run directory"):
        load_runs([tmp_path])  # neither a run nor a sweep


# ------------------------------------------------------------------ the page
def _figure_titles(page: str) -> list[str]:
    return re.findall(r"<figure id=\"figure-\d+\"><figcaption>([^<]*)</figcaption>", page)


def test_the_page_is_one_self_contained_file(tmp_path):
    paths = _two_arms(tmp_path)
    (paths[2] / "warnings.log").write_text(
        "2026-11-24 everyprompt.rewards: 3 x ZeroDivisionError in reward\n"
    )
    runs = load_runs(paths)
    page = render(runs, arms_of(runs), "ablation")
    assert '<table id="summary">' in page and '<table id="keys">' in page and '<table id="levels">' in page
    # every image inline and a real PNG; nothing fetched: no http(s) address in a src or href
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert images and all(base64.b64decode(i)[:8] == b"\x89PNG\r\n\x1a\n" for i in images)
    assert not re.search(r'(src|href)="(https?:)?//', page) and "<script" not in page
    # the figures the runs logged (reward, ZVE stage rates, entropy, time), and only those
    titles = _figure_titles(page)
    logged = {k for r in runs for rec in r.rl.records for k in rec}
    assert titles == [t for t, keys in FIGURES if logged & set(keys)] and len(images) == len(titles)
    assert "ZeroDivisionError" in page  # the run's warnings


def test_report_cli_single_run_html_and_several_runs(tmp_path, capsys):
    paths = _two_arms(tmp_path / "runs")
    assert main(["report", str(paths[0]), "--html"]) == 0
    assert (paths[0] / "report" / "report.html").is_file() and (paths[0] / "report" / "summary.md").is_file()
    capsys.readouterr()
    out_file = tmp_path / "cmp.html"
    assert main(["report", *map(str, paths), "--html", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "loss=espo" in out and "+25.0 pt [+10.0, +40.0]" in out
    assert out_file.is_file()
    assert main(["report", str(tmp_path / "nowhere")]) == 2


@pytest.mark.long  # 9 s on 2 cores: `make test-long`
@needs_chromium
def test_the_page_in_headless_chromium(tmp_path):
    """The browser's view: the table and every figure are there, and every figure decodes as an image."""
    paths = _two_arms(tmp_path / "runs")
    runs = load_runs(paths)
    page = render(runs, arms_of(runs), "ablation")
    assert laid_out(page, tmp_path, "#summary tbody tr") == (len(_figure_titles(page)), 2)
    assert screenshot(page, tmp_path).stat().st_size > 20_000  # a drawn page, not a blank one


def test_a_damaged_sweep_file_is_named_not_a_traceback(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    _run(sweep, "loss=espo,seed=0", "espo", 0, _final(0.5, 0.6))
    (sweep / "sweep.json").write_text(json.dumps({"cells": [{"name": "loss=espo,seed=0", "arm": None}]}))
    (sweep / "status.json").write_text('{"loss=espo,seed=0": {"state": "do')  # cut short by hand
    assert main(["report", str(sweep)]) == 2
    assert "status.json: not valid JSON" in capsys.readouterr().err
    (sweep / "sweep.json").write_text("{}")
    with pytest.raises(ReportError, match="sweep.json: not a sweep plan"):
        load_runs([sweep])


def test_every_summary_row_and_table_column_names_a_known_figure():
    """A `how` is a REDUCTIONS entry (or one of the two-figure rows, or the final eval): a misspelt one
    fails here, not as a KeyError in a user's report."""
    from everyprompt.report import REDUCTIONS, ROWS
    from everyprompt.report.compare import FINAL, INITIAL

    assert {how for _, _, how in ROWS} - set(REDUCTIONS) == {"ends", "evals"}
    assert {c.how for c in COLUMNS} <= {FINAL, INITIAL, *REDUCTIONS}
    # each reduction by hand on [1, nan, 3, 2]: non-finite values are skipped
    values = [1.0, float("nan"), 3.0, 2.0]
    expected = {"mean": 2.0, "median": 2.0, "max": 3.0, "min": 1.0, "any": 3.0, "sum": 6.0, "last tenth": 2.0}
    assert {name: reduce(values) for name, reduce in REDUCTIONS.items()} == expected


def test_a_demo_s_accuracy_before_rl_stands_beside_the_after(tmp_path):
    """A run that evaluated before RL (a demo's summary.json) shows that figure in its own column."""
    from everyprompt.report.compare import figures

    runs = []
    for seed, (before, after) in enumerate([(0.40, 0.60), (0.50, 0.70)]):
        run = _run(tmp_path, f"demo-{seed}", "ppo_clip", seed, final=None)
        summary_json = {
            "eval_before_rl": {"greedy_accuracy": before},
            "eval_after_rl": {"greedy_accuracy": after},
        }
        (run / "summary.json").write_text(json.dumps(summary_json))
        runs.append(run)
    loaded = load_runs(runs)
    arms = arms_of(loaded)
    columns, table = summary(arms)
    labels = [c.label for c in columns]
    assert labels[:2] == ["held-out greedy before RL", "held-out greedy"]
    assert table[0][0].spread.mean == pytest.approx(0.45) and table[0][1].spread.mean == pytest.approx(0.65)
    # reward/mean and reward/accuracy are the same series here (a 0/1 reward): one panel, not two
    (title, png), *_ = figures(arms)
    assert title == "training reward"
    page = render(loaded, arms, "t")
    assert "held-out greedy before RL" in page and "reward/mean" not in page.split("training reward")[0]


def test_a_reward_whose_mean_differs_from_its_accuracy_keeps_both_panels(tmp_path):
    from everyprompt.report.compare import _seeds_series
    from everyprompt.report.summary import distinct

    extra = {step: {"reward/mean": 0.05 * step} for step in range(1, 11)}
    arms = arms_of(load_runs([_run(tmp_path, "r", "ppo_clip", 0, extra=extra)]))
    keys = ["reward/mean", "reward/accuracy"]
    assert distinct(keys, lambda key: _seeds_series(arms, key)) == keys
    same = arms_of(load_runs([_run(tmp_path, "s", "ppo_clip", 0)]))
    assert distinct(keys, lambda key: _seeds_series(same, key)) == ["reward/mean"]
