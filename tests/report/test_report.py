"""`everyprompt report`: summary figures by hand, the files it writes, and its errors."""

import json
import math

import pytest

from everyprompt.data import DataError
from everyprompt.report import ReportError, format_row, load_metrics, report, summarize


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _run(tmp_path):
    """20 RL steps: accuracy 0.1 .. 2.0 / 10, an eval at steps 10 and 20, step 5 logged twice (a resume
    re-logs it; the second record wins), a NaN loss at step 7, the peak memory 1.05 .. 1.6 GiB."""
    records = []
    for step in range(1, 21):
        record = {
            "step": step,
            "reward/accuracy": step / 20,
            "loss/policy": float("nan") if step == 7 else -0.01 * step,
            "zve/zero_variance_rate": 0.5 if step <= 10 else 0.1,
            "rollout/tokens_per_s": float(step * 100),
            "actor/skipped_updates": 1.0 if step == 7 else 0.0,
            "memory/peak_rss_gib": 1.0 + 0.05 * min(step, 12),  # a high-water mark: rises, then stays
        }
        if step % 10 == 0:
            record["eval/greedy_accuracy"] = 0.4 if step == 10 else 0.7
            record["eval/pass@4"] = 0.6 if step == 10 else 0.9
        records.append(record)
    stale = dict(records[4], **{"reward/accuracy": 0.99})
    _write(tmp_path / "metrics.jsonl", [*records[:5], stale, *records[5:]])
    (tmp_path / "config.yaml").write_text("eval:\n  pass_k: 4\nrl:\n  loss: espo\n")
    return records


def test_each_step_counts_once_and_the_last_record_wins(tmp_path):
    _run(tmp_path)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 21  # step 5 twice in the file
    metrics = load_metrics(tmp_path / "metrics.jsonl")
    assert metrics.steps == list(range(1, 21))
    assert metrics.series("reward/accuracy")[1][4] == 0.99  # the re-logged step 5


def test_summary_figures_by_hand(tmp_path):
    _run(tmp_path)
    rows = {r["key"]: r for r in summarize(load_metrics(tmp_path / "metrics.jsonl"), pass_k=4)}
    # accuracy: first tenth = steps 1-2 (0.05, 0.10) -> 0.075; last tenth = steps 19-20 (0.95, 1.0) -> 0.975
    assert rows["reward/accuracy"]["first"] == pytest.approx(0.075)
    assert rows["reward/accuracy"]["last"] == pytest.approx(0.975)
    assert rows["reward/accuracy"]["steps_each"] == 2
    # evals: first and last logged value, with their steps
    ev = rows["eval/greedy_accuracy"]
    assert (ev["first"], ev["first_step"], ev["last"], ev["last_step"]) == (0.4, 10, 0.7, 20)
    assert rows["eval/pass@4"]["label"] == "held-out pass@4" and rows["eval/pass@4"]["last"] == 0.9
    # zero-variance rate: 10 steps at 0.5, 10 at 0.1 -> mean 0.3
    assert rows["zve/zero_variance_rate"]["value"] == pytest.approx(0.3)
    # tokens/s 100..2000 by 100: median of 20 values = (1000 + 1100) / 2
    assert rows["rollout/tokens_per_s"]["value"] == pytest.approx(1050)
    # the NaN loss is counted, not averaged: mean of -0.01 * (1..20 without 7) = -0.01 * 203 / 19
    assert rows["loss/policy"]["non_finite"] == 1
    assert rows["loss/policy"]["value"] == pytest.approx(-0.01 * 203 / 19)
    assert rows["actor/skipped_updates"]["value"] == 1.0
    assert "mismatch/logp_abs_diff" not in rows  # not logged, no row
    assert format_row(rows["reward/accuracy"]) == "0.075 -> 0.975 (first / last 2 steps)"
    assert format_row(rows["actor/skipped_updates"]) == "1 (sum)"
    assert rows["memory/peak_rss_gib"]["value"] == pytest.approx(1.6)  # the largest, reached at step 12
    assert format_row(rows["memory/peak_rss_gib"]) == "1.600 (max)"
    assert "memory/cuda_peak_gib" not in rows  # a CPU run logs no CUDA figure


def test_report_writes_summary_markdown_and_curves(tmp_path):
    _run(tmp_path)
    summary = report(tmp_path)
    assert summary["rl"]["steps"] == 20 and "sft" not in summary
    assert summary["config"] == {"model": "built-in tiny MoE", "loss": "espo"}
    assert summary["rl"]["panels"] == [
        "training reward",
        "held-out greedy accuracy",
        "policy loss",
        "zero-variance groups",
        "rollout tokens/s",
        "learner's peak memory (GiB)",
    ]
    out = tmp_path / "report"
    assert json.loads((out / "summary.json").read_text())["rl"]["last_step"] == 20
    assert (out / "rl_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (out / "summary.md").read_text()
    assert (
        "| policy loss |" in text and "1 non-finite values" in text and "![rl curves](rl_curves.png)" in text
    )


def test_an_empty_metrics_file_reports_zero_steps(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    summary = report(tmp_path)
    assert summary["rl"] == {"steps": 0, "rows": [], "curves": None}


@pytest.mark.parametrize(
    "content, error, message",
    [
        ('{"step": 1}\n{"step": 2\n', DataError, r"metrics.jsonl:2: not valid JSON"),
        ('{"step": 1}\n[1, 2]\n', DataError, r"metrics.jsonl:2: expected a JSON object, got list"),
        ('{"loss": 1.0}\n', DataError, r"metrics.jsonl:1: missing field\(s\) \['step'\]"),
        ('{"step": "3"}\n', ReportError, r"metrics.jsonl: expected integer steps, got step '3'"),
    ],
)
def test_malformed_metrics_name_the_file_and_line(tmp_path, content, error, message):
    (tmp_path / "metrics.jsonl").write_text(content)
    with pytest.raises(error, match=message):
        report(tmp_path)


def test_missing_run_directory_and_missing_metrics_are_clear_errors(tmp_path):
    with pytest.raises(ReportError, match="no such run directory"):
        report(tmp_path / "nope")
    with pytest.raises(ReportError, match="no metrics.jsonl"):
        report(tmp_path)


def test_moving_average_by_hand():
    from everyprompt.report import moving_average

    # windows of 2 over 1, 2, 4, NaN, 8: 1.5, 3, 4 (NaN skipped), 8
    assert moving_average([1.0, 2.0, 4.0, float("nan"), 8.0], 2) == [1.5, 3.0, 4.0, 8.0]


def test_nan_only_series_summarises_to_nan(tmp_path):
    _write(tmp_path / "metrics.jsonl", [{"step": 1, "loss/policy": float("nan")}])
    [row] = summarize(load_metrics(tmp_path / "metrics.jsonl"))
    assert math.isnan(row["value"]) and row["non_finite"] == 1
    assert format_row(row) == "nan (mean)"


def test_the_accuracy_table_shows_pass_at_k_only_when_the_evaluation_sampled():
    from rich.console import Console

    from everyprompt.report.console import accuracy_table

    def rendered(before, after):
        console = Console(width=200, record=True)
        console.print(accuracy_table(before, after, "pass@4"))
        return console.export_text()

    greedy = rendered({"greedy_accuracy": 0.407}, {"greedy_accuracy": 0.527})
    assert "+12.0 pt" in greedy and "pass@4" not in greedy and "nan" not in greedy
    sampled = rendered(
        {"greedy_accuracy": 0.5, "pass@4": 0.6, "greedy_accuracy/level_1": 0.5, "pass@4/level_1": 0.6},
        {"greedy_accuracy": 0.7, "pass@4": 0.9, "greedy_accuracy/level_1": 0.7, "pass@4/level_1": 0.9},
    )
    assert "pass@4 before" in sampled and "90.0%" in sampled and "level 1" in sampled


def test_a_refused_graph_capture_is_a_summary_row(tmp_path):
    """A run whose engine refused its CUDA graphs in step 2 says so in its summary: a flag, and how many
    decode steps ran without their graph (steps 2 and 3: 40 and 50)."""
    records = [
        {
            "step": 1,
            "rollout/graph_failed": 0.0,
            "rollout/graph_eager_steps": 0.0,
            "rollout/decode_step_ms": 2.0,
        },
        {
            "step": 2,
            "rollout/graph_failed": 1.0,
            "rollout/graph_eager_steps": 40.0,
            "rollout/decode_step_ms": 12.0,
        },
        {
            "step": 3,
            "rollout/graph_failed": 1.0,
            "rollout/graph_eager_steps": 50.0,
            "rollout/decode_step_ms": 13.0,
        },
    ]
    _write(tmp_path / "metrics.jsonl", records)
    rows = {r["key"]: r for r in summarize(load_metrics(tmp_path / "metrics.jsonl"))}
    assert rows["rollout/graph_failed"]["label"] == "CUDA graph capture refused"
    assert format_row(rows["rollout/graph_failed"]) == "yes (in some step)"
    assert (
        rows["rollout/graph_eager_steps"]["value"] == 90.0 and rows["rollout/decode_step_ms"]["value"] == 12.0
    )
    plain = tmp_path / "plain"
    plain.mkdir()
    _write(plain / "metrics.jsonl", [{"step": 1, "rollout/decode_step_ms": 3.0}])
    keys = {r["key"] for r in summarize(load_metrics(plain / "metrics.jsonl"))}
    assert "rollout/graph_failed" not in keys  # an engine without graphs logs no such figure: no row


def test_a_compiled_path_given_up_is_a_summary_row(tmp_path):
    """The compiled decode step given up in step 2 (rollout.compile) and the learner's 30 compiled layers
    back to eager in step 3 (model.kernels=compiled): the flag at its largest, the layers at their fewest."""
    records = [
        {"step": 1, "rollout/compile_failed": 0.0, "actor/compiled_layers": 30.0},
        {"step": 2, "rollout/compile_failed": 1.0, "actor/compiled_layers": 30.0},
        {"step": 3, "rollout/compile_failed": 1.0, "actor/compiled_layers": 0.0},
    ]
    _write(tmp_path / "metrics.jsonl", records)
    rows = {r["key"]: r for r in summarize(load_metrics(tmp_path / "metrics.jsonl"))}
    assert format_row(rows["rollout/compile_failed"]) == "yes (in some step)"
    assert format_row({**rows["rollout/compile_failed"], "value": 0.0}) == "no"
    assert rows["actor/compiled_layers"]["label"] == "learner's layers running compiled (fewest)"
    assert format_row(rows["actor/compiled_layers"]) == "0.000 (min)"
