"""The console's tables say what their rows are and why a column is missing."""

from __future__ import annotations

from rich.console import Console

from everyprompt.report.console import eval_table


def _text(table) -> str:
    console = Console(width=120, record=True)
    console.print(table)
    return console.export_text()


def test_an_evaluation_without_samples_has_no_pass_k_column_and_says_why():
    results = {"num_prompts": 150, "greedy_accuracy": 0.487, "greedy_accuracy/level_1": 0.8,
               "greedy_accuracy/level_2": 0.5, "greedy_accuracy/level_4": 0.16}  # fmt: skip
    text = _text(eval_table(results, 4))
    assert "pass@4" in text and "eval.num_samples=0" in text and " - " not in text
    assert "level 1" in text and "level 4" in text and "data.levels" in text
    assert "48.7%" in text


def test_a_sampled_evaluation_shows_pass_k_per_split():
    results = {"num_prompts": 10, "greedy_accuracy": 0.5, "pass@4": 0.7, "greedy_accuracy/level_1": 0.5,
               "pass@4/level_1": 0.7}  # fmt: skip
    text = _text(eval_table(results, 4))
    assert "70.0%" in text and "num_samples" not in text
